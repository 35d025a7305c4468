"""Where a dataset's rows live: in memory, or, past a memory budget, in memory-mapped ``.npy``
files of an on-disk cache.

``load_dataset(..., lean=True)`` builds a dataset inside ``using(Store(folder, budget))``;
the builders allocate their split arrays with ``allocate``, which gives ordinary tensors while
the split fits ``budget`` and tensors over ``numpy`` memmaps in ``folder`` past it. The
folder is private to the build and renamed into place when complete (``publish``), so
processes loading the same dataset at once never write the same files. The published folder
is a cache: a later run with the same data config and the same files maps it again
(``data/cache.py:load_cached``) instead of decoding every image.

A Flower node, whose every message is a fresh process, keeps what it built the same way
(``cache.mapped``): the first message writes the node's data to the cache, the next ones
map it. This module holds the arrays' side (budget, folders, keys, allocation, mapping);
``data/cache.py`` the FederatedData a cache folder holds.

The cache lives in ``$PROTOFL_CACHE``, else ``$XDG_CACHE_HOME/protofl``, else
``~/.cache/protofl``; the budget is ``$PROTOFL_DATA_BUDGET_MB``, else a quarter of the
machine's memory.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from protofl.errors import ProtoflError
from protofl.sizes import env_mib

BUDGET_ENV = "PROTOFL_DATA_BUDGET_MB"
CACHE_ENV = "PROTOFL_CACHE"
VERSION = 2  # bump when the layout of cached arrays changes
META = "meta.json"
LABELS = "labels.npz"


def data_budget() -> int:
    """Bytes of rows a dataset may hold in memory before it is memory-mapped from disk."""
    given = env_mib(BUDGET_ENV)
    if given is not None:
        return given
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 4 << 30


def cache_home() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "protofl"


def fingerprint(root: str | Path | None) -> list:
    """(relative path, size, mtime) of every file under ``root`` (or of ``root`` itself), so a
    changed, added or removed file gives a new cache key; the cache folder is skipped."""
    if not root:
        return []
    root = Path(root).expanduser()
    if root.is_file():
        st = root.stat()
        return [[root.name, st.st_size, st.st_mtime_ns]]
    skip = cache_home().resolve()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath).resolve() == skip:
            dirnames[:] = []
            continue
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath) / name
            try:
                st = p.stat()
            except OSError:
                continue
            out.append([str(p.relative_to(root)), st.st_size, st.st_mtime_ns])
    return out


def cache_key(config: dict, root: str | Path | None) -> str:
    """A short hash of the data config and of the files it reads."""
    blob = json.dumps({"version": VERSION, "config": config, "files": fingerprint(root)},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class Store:
    """Allocation policy of one dataset build: arrays go to ``folder`` as memmaps once the
    split's bytes exceed ``budget`` (``spilled`` then says so)."""

    folder: Path
    budget: int
    spilled: bool = False
    maps: list = field(default_factory=list)  # the memmaps written by this build

    def spill(self, nbytes: int) -> bool:
        """Whether a split of ``nbytes`` goes to disk (decided once per build)."""
        self.spilled = self.spilled or nbytes > self.budget
        return self.spilled


_current: contextvars.ContextVar[Store | None] = contextvars.ContextVar("store", default=None)


@contextlib.contextmanager
def using(store: Store | None) -> Iterator[Store | None]:
    """Builders called inside allocate through ``store``."""
    token = _current.set(store)
    try:
        yield store
    finally:
        _current.reset(token)


def current() -> Store | None:
    return _current.get()


def allocate(name: str, shape: tuple[int, ...], dtype: torch.dtype, disk: bool) -> torch.Tensor:
    """An uninitialised tensor: in memory, or (``disk`` and a current store) a memmap file
    ``name.npy`` in the store's folder."""
    store = current()
    if not disk or store is None or int(np.prod(shape)) == 0:
        return torch.empty(shape, dtype=dtype)
    store.folder.mkdir(parents=True, exist_ok=True)
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    arr = np.lib.format.open_memmap(store.folder / f"{name}.npy", mode="w+", dtype=np_dtype,
                                    shape=shape)
    store.maps.append(arr)
    return torch.from_numpy(arr)


def mapped_file(t: torch.Tensor) -> str | None:
    """The file ``t``'s memory is mapped from (Linux ``/proc/self/maps``), or None."""
    ptr = t.data_ptr()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                lo, hi = (int(v, 16) for v in fields[0].split("-"))
                if lo <= ptr < hi:
                    name = fields[5].strip() if len(fields) == 6 else ""
                    return name if name.startswith("/") else None  # not [heap], [anon]...
    except OSError:  # pragma: no cover - no procfs
        return None
    return None


def _map(folder: Path, name: str, shape: list[int], dtype: str) -> torch.Tensor:
    if int(np.prod(shape)) == 0:
        return torch.from_numpy(np.empty(shape, dtype=np.dtype(dtype)))
    arr = np.load(folder / f"{name}.npy", mmap_mode="c")  # copy-on-write: the file stays put
    if list(arr.shape) != list(shape) or arr.dtype != np.dtype(dtype):
        raise ProtoflError(f"dataset cache {folder} is damaged ({name}.npy is {arr.shape} "
                           f"{arr.dtype}, meta says {shape} {dtype}); delete the folder")
    return torch.from_numpy(arr)
