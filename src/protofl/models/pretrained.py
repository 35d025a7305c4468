"""Reading a local torchvision-style state_dict for ``model.pretrained`` (no download): the
checks every encoder that loads one shares."""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from protofl.errors import ProtoflError
from protofl.models.norms import group_norm_from_bn

log = logging.getLogger("protofl")


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The state_dict saved at ``path`` (a bare one, or under ``"state_dict"``; a
    ``module.`` prefix of DataParallel dropped). An unreadable file is one clear error."""
    p = Path(path)
    if not p.is_file():
        raise ProtoflError(f"model.pretrained: no file at {p}")
    try:
        source = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "unsupported global" not in str(e).lower():  # no refused object: not a state_dict
            raise ProtoflError(f"model.pretrained: {p} is not a readable state_dict "
                               f"({str(e).strip().splitlines()[0]})") from None
        raise ProtoflError(  # torch's advice to load with weights_only=False: no
            f"model.pretrained: {p} holds pickled objects besides tensors, which protofl does "
            "not load (loading them could run code); save the weights alone: "
            "torch.save(model.state_dict(), path)") from None
    except Exception as e:  # noqa: BLE001 - any unreadable file is the user's input problem
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ProtoflError(f"model.pretrained: {p} is not a readable state_dict "
                           f"({first})") from None
    if isinstance(source, dict) and isinstance(source.get("state_dict"), dict):
        source = source["state_dict"]
    if not isinstance(source, dict):
        raise ProtoflError(f"model.pretrained: {p} does not hold a state_dict")
    return {str(k).removeprefix("module."): v for k, v in source.items()}


def source_tensor(source: dict, key: str, path: str | Path, what: str) -> torch.Tensor | None:
    """``source[key]`` as a tensor; None for a missing ``num_batches_tracked`` (older
    torchvision files lack it); any other missing key is an error naming it and ``what``
    the file should be."""
    if key not in source:
        if key.endswith("num_batches_tracked"):
            return None
        raise ProtoflError(f"model.pretrained: {path} lacks {key!r} (not a {what} state_dict?)")
    w = source[key]
    if not isinstance(w, torch.Tensor):
        raise ProtoflError(f"model.pretrained: {key!r} in {path} is not a tensor")
    return w


def check_norm(cfg) -> None:
    """``model.norm = frozen`` takes its statistics from ``model.pretrained``: an error
    without one."""
    if getattr(cfg, "norm", None) == "frozen" and not getattr(cfg, "pretrained", None):
        raise ProtoflError("config: model.norm = frozen freezes the pretrained BatchNorm "
                           "statistics, so it needs model.pretrained (a state_dict file)")


def convert_group_norms(module: nn.Module, source: dict, key_of: Callable[[str], str | None]
                        ) -> int:
    """Every GroupNorm of ``module`` whose BatchNorm counterpart in ``source`` (module name
    ``key_of(name)``) has running statistics gets the affine of
    :func:`protofl.models.norms.group_norm_from_bn`; returns how many."""
    done = 0
    for name, m in module.named_modules():
        key = key_of(name) if isinstance(m, nn.GroupNorm) else None
        if key is None or f"{key}.running_var" not in source:
            continue
        w, b, mean, var = (source[f"{key}.{t}"] for t in
                           ("weight", "bias", "running_mean", "running_var"))
        if mean.numel() != m.num_channels:
            continue  # the shape check of the weights names the key
        group_norm_from_bn(m, w, b, mean, var)
        done += 1
    if done:
        log.warning("model.pretrained: %d BatchNorm layers carried into GroupNorm, which keeps "
                    "the pretrained features only in part (docs/datasets.md); model.norm = "
                    "frozen keeps them exactly", done)
    return done
