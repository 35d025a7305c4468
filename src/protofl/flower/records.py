"""Nested dicts of tensors <-> Flower records.

A tree travels as two records: an ``ArrayRecord`` holding every tensor leaf under the key
``"0"``, ``"1"``, ... (as numpy arrays, dtype kept), and a ``ConfigRecord`` holding the tree's
skeleton as JSON: each leaf becomes ``[index, shape]`` (Flower stores 0-d arrays as shape
``(1,)``, so the shape is kept here), empty sub-dicts are kept. The skeleton is needed
because parameter names themselves contain dots, so ``protofl.algorithms.base.flatten``'s
``a.b.c`` keys cannot be split back into a tree.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from protofl.algorithms.base import Tensors
from protofl.errors import ProtoflError

TREE_KEY = "tree"


def _skeleton(tree: Tensors, leaves: list[torch.Tensor], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out[k] = _skeleton(v, leaves, f"{where}{k}.")
        elif isinstance(v, torch.Tensor):
            out[k] = [len(leaves), list(v.shape)]
            leaves.append(v)
        else:
            raise ProtoflError(f"{where}{k} is a {type(v).__name__}, not a tensor")
    return out


def tree_to_records(tree: Tensors, name: str, into: RecordDict) -> RecordDict:
    """Store ``tree`` in ``into`` as ``name`` (ArrayRecord) and ``name + '.tree'``."""
    leaves, skeleton = tree_to_arrays(tree)
    into[name] = ArrayRecord({str(i): Array(a) for i, a in enumerate(leaves)})
    into[f"{name}.{TREE_KEY}"] = ConfigRecord({"json": skeleton})
    return into


def _rebuild(skeleton: Any, arrays: ArrayRecord, where: str) -> Tensors:
    if not isinstance(skeleton, dict):
        raise ProtoflError(f"{where or 'tree'}: skeleton is not a mapping")
    out: Tensors = {}
    for k, v in skeleton.items():
        if isinstance(v, dict):
            out[k] = _rebuild(v, arrays, f"{where}{k}.")
        elif (isinstance(v, list) and len(v) == 2 and isinstance(v[0], int)
              and str(v[0]) in arrays and isinstance(v[1], list)):
            a = np.array(arrays[str(v[0])].numpy(), copy=True)
            out[k] = torch.from_numpy(a.reshape(v[1]))
        else:
            raise ProtoflError(f"{where}{k}: no array {v!r} in the record")
    return out


def tree_from_records(content: RecordDict, name: str) -> Tensors:
    """The tree stored by :func:`tree_to_records`; ProtoflError naming what is malformed."""
    try:
        arrays = content.array_records[name]
        skeleton = json.loads(str(content.config_records[f"{name}.{TREE_KEY}"]["json"]))
    except KeyError as e:
        raise ProtoflError(f"record {name!r} is missing ({e.args[0]!r})") from None
    except (TypeError, ValueError) as e:
        raise ProtoflError(f"record {name!r} has an unreadable skeleton: {e}") from None
    try:
        return _rebuild(skeleton, arrays, "")
    except (TypeError, ValueError) as e:  # a corrupt array payload
        raise ProtoflError(f"record {name!r} holds an unreadable array: {e}") from None


def tree_to_arrays(tree: Tensors) -> tuple[list[np.ndarray], str]:
    """``tree`` as a list of numpy arrays and its skeleton (JSON), for the legacy ``FitIns``
    / ``FitRes`` messages secure aggregation travels in."""
    leaves: list[torch.Tensor] = []
    skeleton = _skeleton(tree, leaves, "")
    return [np.ascontiguousarray(t.detach().cpu().numpy()) for t in leaves], json.dumps(skeleton)


def tree_from_arrays(arrays: list[np.ndarray], skeleton: str) -> Tensors:
    """The tree :func:`tree_to_arrays` sent; ProtoflError naming what is malformed."""
    record = ArrayRecord()
    for i, a in enumerate(arrays):
        record[str(i)] = Array(np.asarray(a))
    try:
        return _rebuild(json.loads(skeleton), record, "")
    except (TypeError, ValueError) as e:
        raise ProtoflError(f"broadcast arrays do not match their skeleton: {e}") from None
