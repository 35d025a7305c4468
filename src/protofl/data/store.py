"""Where a dataset's rows live: in memory, or, past a memory budget, in memory-mapped ``.npy``
files of an on-disk cache.

``load_dataset(..., lean=True)`` builds a dataset inside ``using(Store(folder, budget))``;
the builders allocate their split arrays with ``allocate``, which gives ordinary tensors while
the split fits ``budget`` and tensors over ``numpy`` memmaps in ``folder`` past it. The
folder is private to the build and renamed into place when complete (``publish``), so
processes loading the same dataset at once never write the same files. The published folder
is a cache: a later run with the same data config and the same files maps it again
(``load_cached``) instead of decoding every image.

A Flower node, whose every message is a fresh process, keeps what it built the same way
(``mapped``): the first message writes the node's data to the cache, the next ones map it.

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
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from protofl.errors import ProtoflError

BUDGET_ENV = "PROTOFL_DATA_BUDGET_MB"
CACHE_ENV = "PROTOFL_CACHE"
VERSION = 2  # bump when the layout of cached arrays changes
META = "meta.json"
LABELS = "labels.npz"


def data_budget() -> int:
    """Bytes of rows a dataset may hold in memory before it is memory-mapped from disk."""
    mb = os.environ.get(BUDGET_ENV)
    if mb:
        try:
            return int(float(mb) * (1 << 20))
        except ValueError:
            raise ProtoflError(f"{BUDGET_ENV} = {mb!r} is not a number of MiB") from None
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


def save_meta(store: Store, data) -> None:
    """Flush a build's memmaps and write labels, offsets and the container's small fields
    next to them; the meta file, written last, marks the cache complete."""
    folder = store.folder
    for arr in store.maps:
        arr.flush()
    per_image = {k: getattr(data, k).numpy() for k in ("labels_train", "labels_local_test",
                                                       "labels_test")
                 if getattr(data, k) is not None}  # segmentation: each image's object class
    np.savez(folder / LABELS, y_train=data.y_train.numpy(), y_local_test=data.y_local_test.numpy(),
             y_test=data.y_test.numpy(), train_offsets=data.train_offsets,
             test_offsets=data.test_offsets, **per_image)
    arrays = {k: {"shape": list(getattr(data, k).shape),
                  "dtype": str(getattr(data, k).numpy().dtype)}
              for k in ("x_train", "x_local_test", "x_test")}
    meta = {"version": VERSION, "name": data.name, "num_classes": data.num_classes,
            "class_names": data.class_names, "scale": data.scale, "mean": data.mean,
            "std": data.std, "arrays": arrays,
            "test_is_local": data.x_test is data.x_local_test}
    tmp = folder / (META + ".tmp")
    tmp.write_text(json.dumps(meta))
    tmp.replace(folder / META)


def building_folder(folder: Path) -> Path:
    """A private folder to build ``folder``'s cache in (``publish`` renames it into place),
    so processes that load the same dataset at once never write the same files."""
    return folder.with_name(f"{folder.name}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def publish(store: Store, data, folder: Path):
    """Complete the cache built in ``store.folder`` and move it to ``folder``; if another process
    got there first, drop ours and map theirs. Returns the data to use."""
    save_meta(store, data)
    try:
        store.folder.rename(folder)
    except OSError:  # the final folder exists: another process published it
        shutil.rmtree(store.folder, ignore_errors=True)  # our mappings stay valid until dropped
        return load_cached(folder) or data
    return data


def load_cached(folder: Path):
    """The FederatedData a complete cache folder holds (arrays memory-mapped), or None."""
    from protofl.data.federated import FederatedData

    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if meta.get("version") != VERSION:
        return None
    try:
        with np.load(folder / LABELS) as z:
            labels = {k: z[k] for k in z.files}
    except (OSError, ValueError) as e:
        raise ProtoflError(f"dataset cache {folder} is damaged ({e}); delete the folder") from None
    a = meta["arrays"]
    x = {k: _map(folder, k, a[k]["shape"], a[k]["dtype"]) for k in a
         if not (k == "x_test" and meta["test_is_local"])}
    if meta["test_is_local"]:
        x["x_test"] = x["x_local_test"]
    return FederatedData(
        name=meta["name"], num_classes=meta["num_classes"], x_train=x["x_train"],
        y_train=torch.from_numpy(labels["y_train"]), train_offsets=labels["train_offsets"],
        x_local_test=x["x_local_test"], y_local_test=torch.from_numpy(labels["y_local_test"]),
        test_offsets=labels["test_offsets"], x_test=x["x_test"],
        y_test=torch.from_numpy(labels["y_test"]), class_names=meta["class_names"],
        scale=meta["scale"], mean=_floats(meta.get("mean")), std=_floats(meta.get("std")),
        **{k: torch.from_numpy(labels[k]) for k in ("labels_train", "labels_local_test",
                                                    "labels_test") if k in labels})


ARRAYS = ("x_train", "x_local_test", "x_test")


def persist(data, folder: Path):
    """Write an in-memory FederatedData to the cache folder ``folder`` (built privately and
    renamed into place, as ``publish``) and return it mapped from there."""
    part = building_folder(folder)
    part.mkdir(parents=True)
    for name in ARRAYS:
        if not (name == "x_test" and data.x_test is data.x_local_test):
            np.save(part / f"{name}.npy", getattr(data, name).numpy())
    publish(Store(part, 0), data, folder)
    return load_cached(folder) or data


def mapped(kind: str, key: dict, root: str | Path | None, build):
    """The FederatedData ``build()`` returns, built once per machine: kept under
    ``kind-<hash of key, the protofl version and root's files>`` in the cache and mapped from
    there by later calls (other processes included); data already mapped are returned as
    they are."""
    from protofl.provenance import version

    folder = cache_home() / f"{kind}-{cache_key({'protofl': version('protofl'), **key}, root)}"
    data = load_cached(folder)
    if data is not None:
        return data
    data = build()
    if mapped_file(data.x_train) is not None:  # (a large dataset: the loader mapped it)
        return data
    return persist(data, folder)


def _floats(v: list | None) -> tuple[float, ...] | None:
    return None if v is None else tuple(float(a) for a in v)
