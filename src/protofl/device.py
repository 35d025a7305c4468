"""Where a run computes: the device (``device: auto | cpu | cuda | cuda:N | mps``) and the
precision of its forward passes (``precision: fp32 | bf16 | fp16``).

The model, the server state, the active clients' data and states, optimizer states,
aggregation and evaluation live on the run's device (on MPS, which has no float64, the server
state and aggregation stay on the CPU); the dataset stays in host memory and moves there a
client (or a step's batch) at a time. Whatever is kept between rounds or
written (client states, checkpoints) is held on the CPU. On the CPU every helper here is a
no-op, so CPU runs compute exactly what they computed before devices existed.

``deterministic: true`` (``set_deterministic``) makes CUDA runs repeat bit for bit where torch
has deterministic kernels; feature and evaluation passes are sized from the device's free
memory (``forward_rows``), so a small GPU takes fewer rows a pass than a large one.
"""

from __future__ import annotations

import contextlib
import os
import re
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

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


def autocast(device: torch.device | str, precision: str) -> contextlib.AbstractContextManager:
    """Mixed precision for the forward passes inside (``fp32``: nothing changes); a plain
    context object, which ``torch.compile`` traces."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def grad_scaler(device: torch.device | str, precision: str) -> torch.amp.GradScaler | None:
    """A loss scaler for fp16 training (fp16 gradients underflow without one; bf16 has
    float32's exponent range and needs none)."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(torch.device(device).type)


def memory_info(device: torch.device | str) -> tuple[int, int] | None:
    """``(free, total)`` bytes of a CUDA device, counting as free what torch's caching
    allocator holds but does not use (``mem_get_info`` reports it as taken); None elsewhere
    (host memory applies)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached, total


def free_memory(device: torch.device | str) -> int | None:
    """Bytes a chunk of stacked clients, or a forward pass, may take on ``device``: a share
    (``FREE_SHARE``) of a CUDA device's free memory; None elsewhere (the host budget
    applies)."""
    info = memory_info(device)
    return None if info is None else int(info[0] * FREE_SHARE)


def rows_per_pass(device: torch.device | str, row_bytes: int, most: int) -> int:
    """Rows a forward pass may take at once on ``device``: ``most``, or on a device whose free
    memory is known as many rows of ``row_bytes`` as ``free_memory`` holds, if fewer; at
    least 1."""
    free = free_memory(device)
    if free is None:
        return most
    return max(1, min(most, free // max(1, int(row_bytes))))


def activation_bytes(run: Callable[[], object]) -> int:
    """Bytes of every tensor that any module outputs while ``run()`` runs (without gradients):
    for a forward pass, an upper bound of its working set, as if no activation were freed."""
    total = 0

    def count(module: torch.nn.Module, args: Any, out: Any) -> None:
        nonlocal total
        total += sum(t.numel() * t.element_size() for t in tree_flatten(out)[0]
                     if isinstance(t, torch.Tensor))

    handle = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        with torch.no_grad():
            run()
    finally:
        handle.remove()
    return total


_row_bytes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {shape: bytes}


def forward_rows(device: torch.device | str, x: torch.Tensor, most: int,
                 forward: Callable[[torch.Tensor], object],
                 model: torch.nn.Module | None = None) -> int:
    """Rows of ``x`` per pass of ``forward`` (a model's forward pass over rows of ``x``, free
    of side effects: eval mode) on ``device``: ``most`` where the device's free memory is not
    known (the CPU: nothing is run), else at most what ``free_memory`` holds by a probe of
    two rows: their module outputs (``activation_bytes``) plus their own size as float32.
    With ``model``, its probe is kept per row shape and dtype (weights change nothing)."""
    if len(x) == 0 or free_memory(device) is None:
        return most
    kind = torch.device(device).type
    cast = kind in ("cpu", "cuda") and torch.is_autocast_enabled(kind)
    key = (tuple(x.shape[1:]), x.dtype, cast)
    known = _row_bytes.setdefault(model, {}) if model is not None else {}
    if key not in known:
        probe = x[:2]
        known[key] = (activation_bytes(lambda: forward(probe)) // len(probe)
                      + 4 * probe[0].numel())
    return rows_per_pass(device, known[key], most)


CUBLAS_ENV, CUBLAS_DETERMINISTIC = "CUBLAS_WORKSPACE_CONFIG", ":4096:8"
_found: dict | None = None  # torch's settings before set_deterministic(True)


def _settings() -> dict:
    b = torch.backends
    return {"algorithms": (torch.are_deterministic_algorithms_enabled(),
                           torch.is_deterministic_algorithms_warn_only_enabled()),
            "matmul_tf32": b.cuda.matmul.allow_tf32,
            "cudnn": (b.cudnn.allow_tf32, b.cudnn.deterministic, b.cudnn.benchmark),
            "cublas": os.environ.get(CUBLAS_ENV)}


def _apply(s: dict) -> None:
    b = torch.backends
    on, warn_only = s["algorithms"]
    torch.use_deterministic_algorithms(on, warn_only=warn_only)
    b.cuda.matmul.allow_tf32 = s["matmul_tf32"]
    b.cudnn.allow_tf32, b.cudnn.deterministic, b.cudnn.benchmark = s["cudnn"]
    if s["cublas"] is None:
        os.environ.pop(CUBLAS_ENV, None)
    else:
        os.environ[CUBLAS_ENV] = s["cublas"]


def set_deterministic(on: bool) -> None:
    """The config's ``deterministic`` (the engine calls this once per run). ``True``: torch
    must use deterministic kernels (``use_deterministic_algorithms``; an operation that has
    none on CUDA, e.g. the backward of adaptive average pooling or bilinear upsampling, warns
    once and stays nondeterministic), cuDNN picks deterministic algorithms and no benchmark,
    TF32 is off for matrix products and convolutions (float32 throughout), cuBLAS gets a fixed
    workspace (``CUBLAS_WORKSPACE_CONFIG``, unless set; it must be set before the process's
    first CUDA product to matter, so set it in the environment too). ``False``: the settings
    found before the first ``True`` are restored (nothing changes if there was none)."""
    global _found
    if on and _found is None:
        _found = _settings()
        _apply({"algorithms": (True, True), "matmul_tf32": False, "cudnn": (False, True, False),
                "cublas": os.environ.get(CUBLAS_ENV, CUBLAS_DETERMINISTIC)})
    elif not on and _found is not None:
        _apply(_found)
        _found = None
