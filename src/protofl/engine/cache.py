"""protofl's cache folder and its parts: ``protofl cache info|clear``.

The folder is ``$PROTOFL_CACHE``, else ``$XDG_CACHE_HOME/protofl``, else ``~/.cache/protofl``
(``data/store.py``). It holds:

- ``calibration/``: the trainers' costs measured per machine and model
  (``engine/calibrate.py``);
- ``torch/``: torch's compile caches (inductor's FX graph cache and AOT autograd cache, via
  ``TORCHINDUCTOR_CACHE_DIR``), so the compiled trainer's graphs of a model are compiled once
  per machine and torch version, not once per run (unless ``TORCHINDUCTOR_CACHE_DIR`` is set
  already: then torch's own choice stands);
- everything else: built datasets (``data/cache.py``) and Flower nodes' data.

Everything in it is made again when missing.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from protofl.data import store

TORCH = "torch"
CALIBRATION = "calibration"
PARTS = ("calibration", "compiled", "data")


def torch_cache() -> Path:
    return store.cache_home() / TORCH


def use_torch_cache() -> str:
    """Point torch's compile caches at ``torch_cache()`` (before anything is compiled); the
    folder torch uses."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(torch_cache()))
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def part_paths(part: str) -> list[Path]:
    """The files and folders of one part of the cache."""
    home = store.cache_home()
    if part == "calibration":
        return [home / CALIBRATION]
    if part == "compiled":
        return [torch_cache()]
    if not home.is_dir():
        return []
    return sorted(p for p in home.iterdir() if p.name not in (CALIBRATION, TORCH))


def size(path: Path) -> tuple[int, int]:
    """Bytes and files under ``path`` (links not followed)."""
    if path.is_file() or path.is_symlink():
        return path.lstat().st_size, 1
    total = files = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
                files += 1
            except OSError:
                continue
    return total, files


def info() -> list[str]:
    """One line per part: where it is, its files and size."""
    lines = [f"protofl cache: {store.cache_home()}"]
    for part in PARTS:
        total = files = 0
        for p in part_paths(part):
            b, n = size(p)
            total, files = total + b, files + n
        where = {"calibration": "calibration/", "compiled": f"{torch_cache().name}/ "
                 "(torch's compile caches)", "data": "built datasets"}[part]
        lines.append(f"{part:>12}: {files} files, {total / 2**20:.1f} MiB ({where})")
    return lines


def clear(parts: tuple[str, ...] = PARTS) -> list[str]:
    """Remove the given parts of the cache; one line per part removed."""
    lines = []
    for part in parts:
        gone = 0
        for p in part_paths(part):
            if p.is_dir() and not p.is_symlink():
                gone += size(p)[0]
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists() or p.is_symlink():
                gone += size(p)[0]
                p.unlink(missing_ok=True)
        lines.append(f"{part}: removed {gone / 2**20:.1f} MiB")
    return lines
