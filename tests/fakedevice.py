"""A simulated accelerator for testing device plumbing on a CPU-only machine.

Inside ``simulated()``, tensors moved to ``torch.device("meta")`` become :class:`OnDevice`
wrappers around ordinary CPU tensors: they compute exactly what the CPU computes, but refuse
what a CUDA tensor refuses, so a code path that runs here keeps its tensors where a GPU needs
them. Refused, as on CUDA: an operation mixing device tensors with CPU tensors of one or more
dimensions (0-dim CPU tensors are allowed, as CUDA allows them); a CPU tensor indexed with
device indices (the reverse is allowed); a random draw onto the device from a CPU generator;
``.numpy()`` of a device tensor. Allowed, as on CUDA: copies between devices, ``.item()``,
``.tolist()``. ``simulated("mps", float64=False)`` poses as MPS, which also refuses float64
tensors. ``simulated(memory=N)`` gives the device N bytes: the storages of live device tensors
are counted (``Memory``: in use, peak), an allocation past N raises ``torch.OutOfMemoryError``
as CUDA does, and ``protofl.device.memory_info`` reports the free bytes. What it cannot show:
the devices' own numerics, allocator and streams.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("meta")
_current: dict = {"device": DEVICE, "float64": True, "memory": None}  # what ``simulated`` poses as
aten = torch.ops.aten
CROSS_DEVICE = {aten._to_copy.default, aten.copy_.default}  # copies between devices
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
            aten._index_put_impl_.default}


class DeviceMismatch(RuntimeError):
    pass


@dataclass
class Memory:
    """The simulated device's memory: ``cap`` bytes; ``used`` and ``peak`` by the storages of
    live device tensors (a storage shared by views counts once)."""

    cap: int
    used: int = 0
    peak: int = 0
    refs: dict[int, int] = field(default_factory=dict)  # storage address -> live tensors
    sizes: dict[int, int] = field(default_factory=dict)

    def take(self, t: OnDevice) -> None:
        storage = t.inner.untyped_storage()
        key = storage.data_ptr()
        if key not in self.refs:
            size = storage.nbytes()
            if self.used + size > self.cap:
                raise torch.OutOfMemoryError(
                    f"simulated device out of memory: {size} bytes asked, {self.used} of "
                    f"{self.cap} in use")
            self.refs[key], self.sizes[key] = 0, size
            self.used += size
            self.peak = max(self.peak, self.used)
        self.refs[key] += 1
        weakref.finalize(t.inner, self.give, key)  # not t: torch cannot swap a weakly held tensor

    def give(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.used -= self.sizes.pop(key)
            del self.refs[key]

    def info(self, device) -> tuple[int, int] | None:
        """``protofl.device.memory_info`` on the simulated device: ``(free, total)``."""
        if torch.device(device).type != _current["device"].type:
            return None
        return self.cap - self.used, self.cap


class OnDevice(torch.Tensor):
    """A CPU tensor posing as one on the simulated device."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(
            cls, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, device=_current["device"], requires_grad=inner.requires_grad)
        out.inner = inner
        if _current["memory"] is not None:
            _current["memory"].take(out)
        return out

    def __repr__(self) -> str:  # noqa: D105
        return f"OnDevice({self.inner!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return OnDevice(inner["inner"])

    def tolist(self):
        return self.inner.tolist()

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert a device tensor to numpy; copy it to the CPU first")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


def _plain(t: object) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, OnDevice)


def _dispatch(func, args, kwargs):
    flat = tree_flatten((args, kwargs))[0]
    on = any(isinstance(t, OnDevice) for t in flat)
    target = on
    if kwargs.get("device") is not None:
        target = torch.device(kwargs["device"]).type == _current["device"].type
        kwargs = {**kwargs, "device": torch.device("cpu")}
    if func in INDEXING:
        base, rest = args[0], tree_flatten((args[1:], kwargs))[0]
        if _plain(base) and any(isinstance(t, OnDevice) for t in rest):
            raise DeviceMismatch(f"{func}: a CPU tensor indexed with device tensors")
        values = args[2] if func is not aten.index.Tensor else None
        if isinstance(base, OnDevice) and _plain(values) and values.dim() > 0:
            raise DeviceMismatch(f"{func}: CPU values put into a device tensor")
    elif func not in CROSS_DEVICE and on and any(_plain(t) and t.dim() > 0 for t in flat):
        raise DeviceMismatch(f"{func}: expected all tensors on the same device, found device "
                             "tensors and CPU tensors")
    if target and isinstance(kwargs.get("generator"), torch.Generator):
        raise DeviceMismatch(f"{func}: a CPU generator drawing onto the device")
    un = tree_map(lambda t: t.inner if isinstance(t, OnDevice) else t, (args, kwargs))
    out = func(*un[0], **un[1])
    if func is aten.copy_.default:
        return args[0]
    if not target:
        return out
    if not _current["float64"] and any(isinstance(t, torch.Tensor) and t.dtype == torch.float64
                                       for t in tree_flatten(out)[0]):
        raise DeviceMismatch(f"{func}: float64 on a device without float64")
    return tree_map(lambda t: OnDevice(t) if _plain(t) else t, out)


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(t, OnDevice) for t in tree_flatten((args, kwargs))[0]):
            return NotImplemented  # the subclass dispatches these
        return _dispatch(func, args, kwargs)


class _Constructors(TorchFunctionMode):
    """``torch.tensor(data, device=...)`` builds its tensor outside the dispatcher: made on the
    CPU and wrapped instead (a real meta tensor would hold no data)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if func in (torch.tensor, torch.as_tensor) and dev is not None and (
                torch.device(dev).type == _current["device"].type):
            return OnDevice(func(*args, **{**kwargs, "device": "cpu"}))
        return func(*args, **kwargs)


@contextlib.contextmanager
def simulated(device: str = "meta", float64: bool = True, memory: int | None = None
              ) -> Iterator[torch.device]:
    """Run the block with ``device`` (default ``meta``, which no code treats specially) acting
    as an accelerator; ``float64=False`` refuses float64 tensors on it, as MPS does;
    ``memory``: the device holds that many bytes (``current_memory()`` tells its use)."""
    from protofl import device as devices

    old, found = dict(_current), devices.memory_info
    mem = Memory(memory) if memory is not None else None
    _current.update(device=torch.device(device), float64=float64, memory=mem)
    if mem is not None:
        devices.memory_info = mem.info
    try:
        with _Constructors(), _Mode():
            yield _current["device"]
    finally:
        _current.update(old)
        devices.memory_info = found


def current_memory() -> Memory | None:
    """The memory of the device ``simulated(memory=...)`` poses as (None without a cap)."""
    return _current["memory"]


def on_device(tree) -> bool:
    """True when every tensor of a nested structure is on the simulated device."""
    leaves = [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]
    return all(isinstance(t, OnDevice) for t in leaves)


def on_host(tree) -> bool:
    """True when every tensor of a nested structure is an ordinary CPU tensor."""
    leaves = [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]
    return all(_plain(t) and t.device.type == "cpu" for t in leaves)
