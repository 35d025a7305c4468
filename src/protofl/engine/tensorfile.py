"""Nested data with tensors, stored as safetensors: no pickle, so reading never runs code.

The tensors go into the safetensors body; the structure (dicts with str or int keys, lists,
tuples, ints, floats, bools, strings, None) goes into the header's metadata as JSON, each tensor
replaced by a reference. Tensors come back on the CPU, detached, with their dtype and shape.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

META_KEY = "protofl"
FORMAT = 1
_TAG = "$t"
_SPECIAL = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _pack(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(obj, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = obj.detach().cpu().contiguous().clone()  # clone: no shared storage
        return {_TAG: "tensor", "id": name}
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {_TAG: "float", "v": repr(obj)}
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise TypeError(f"cannot store a {type(k).__name__} dict key at {where}")
            items.append([k, _pack(v, tensors, f"{where}.{k}")])
        return {_TAG: "dict", "items": items}
    if isinstance(obj, (list, tuple)):
        packed = [_pack(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
        return packed if isinstance(obj, list) else {_TAG: "tuple", "items": packed}
    raise TypeError(f"cannot store a {type(obj).__name__} at {where}")


def _unpack(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_unpack(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    tag = obj.get(_TAG)
    if tag == "tensor":
        return tensors[obj["id"]]
    if tag == "float":
        return _SPECIAL[obj["v"]]
    if tag == "tuple":
        return tuple(_unpack(v, tensors) for v in obj["items"])
    if tag == "dict":
        out = {}
        for k, v in obj["items"]:
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise ValueError("a dict key is neither a string nor an integer")
            out[k] = _unpack(v, tensors)
        return out
    raise ValueError(f"unknown entry {tag!r}")


def encode(obj: Any) -> bytes:
    """``obj`` as safetensors bytes; a TypeError names the first value that cannot be stored."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _pack(obj, tensors, "payload")
    meta = json.dumps({"format": FORMAT, "data": skeleton}, allow_nan=False)
    return st_save(tensors, metadata={META_KEY: meta})


def decode(data: bytes) -> Any:
    """The object ``encode`` stored; ValueError (with a short reason) for anything else."""
    if len(data) < 8:
        raise ValueError("too short for a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ValueError("not a safetensors file (bad header length)")
    try:
        header = json.loads(data[8:8 + n])
        meta = json.loads(header["__metadata__"][META_KEY])
        tensors = st_load(data)
    except Exception as e:  # any malformed header or body
        raise ValueError(f"not a protofl safetensors file ({type(e).__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError("not a protofl checkpoint of a format this version reads")
    try:
        return _unpack(meta["data"], tensors)
    except (KeyError, TypeError) as e:
        raise ValueError(f"damaged structure ({type(e).__name__}: {e})") from None
