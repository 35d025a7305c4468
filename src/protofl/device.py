"""Where a run computes: the device (``device: auto | cpu | cuda | cuda:N | mps``) and the
precision of its forward passes (``precision: fp32 | bf16 | fp16``).

The model, the server state, the active clients' data and states, optimizer states,
aggregation and evaluation live on the run's device (on MPS, which has no float64, the server
state and aggregation stay on the CPU); the dataset stays in host memory and moves there a
client (or a step's batch) at a time. Whatever is kept between rounds or
written (client states, checkpoints) is held on the CPU. On the CPU every helper here is a
no-op, so CPU runs compute exactly what they computed before devices existed.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map

from protofl.config import DEVICES
from protofl.errors import ProtoflError

CPU = torch.device("cpu")
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
FREE_SHARE = 0.8  # share of a CUDA device's free memory the vectorized trainer may plan for


def resolve(name: str) -> torch.device:
    """The ``torch.device`` a config's ``device`` names; ``auto`` is CUDA when present, else the
    CPU. A device that is not there stops the run with one line."""
    if not re.fullmatch(DEVICES, name):
        raise ProtoflError(f"config: device = {name!r}; allowed: auto, cpu, cuda, cuda:N or mps")
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else CPU
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ProtoflError(f"config: device = {name!r} but this torch sees no CUDA device "
                               f"(torch {torch.__version__}); use device: cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ProtoflError(f"config: device = {name!r} but there are only "
                               f"{torch.cuda.device_count()} CUDA devices")
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None)
                                  and torch.backends.mps.is_available()):
        raise ProtoflError("config: device = 'mps' but MPS is not available here")
    return dev


def to_device(tree: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """Every tensor of a nested structure on ``device`` (tensors already there are kept, not
    copied)."""
    return tree_map(lambda v: v.to(device, non_blocking=non_blocking)
                    if isinstance(v, torch.Tensor) else v, tree)


def to_host(tree: Any) -> Any:
    """Every tensor of a nested structure on the CPU (what is stored or checkpointed)."""
    return to_device(tree, CPU)


def upload(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host rows on ``device``: through pinned memory to a CUDA device (an asynchronous copy),
    unchanged on the CPU."""
    device = torch.device(device)
    if device.type != "cuda" or x.device.type != "cpu":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's weights (the CPU for a model without parameters)."""
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else CPU


def float64(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64: on its device, or on the CPU from a device without float64 (MPS)."""
    return t.double() if has_float64(t.device) else t.cpu().double()


def has_float64(device: torch.device | str) -> bool:
    """Whether ``device`` computes in float64 (MPS does not)."""
    return torch.device(device).type != "mps"


def server_device(device: torch.device | str) -> torch.device:
    """Where the server state lives and aggregation runs: the run's device, or the CPU for a
    device without float64 (several algorithms aggregate in float64)."""
    device = torch.device(device)
    return device if has_float64(device) else CPU


def wide(device: torch.device | str) -> torch.dtype:
    """The dtype of the trainers' accumulators (losses, step counts): float64, or float32 on a
    device without float64."""
    return torch.float64 if has_float64(device) else torch.float32


@contextlib.contextmanager
def autocast(device: torch.device | str, precision: str) -> Iterator[None]:
    """Mixed precision for the forward passes inside (``fp32``: nothing changes)."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        yield
        return
    with torch.autocast(torch.device(device).type, dtype=dtype):
        yield


def grad_scaler(device: torch.device | str, precision: str) -> torch.amp.GradScaler | None:
    """A loss scaler for fp16 training (fp16 gradients underflow without one; bf16 has
    float32's exponent range and needs none)."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(torch.device(device).type)


def free_memory(device: torch.device | str) -> int | None:
    """Bytes a chunk of stacked clients may take on ``device``: a share of a CUDA device's free
    memory; None elsewhere (the host budget applies)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * FREE_SHARE)
