"""Where reports may be written: never inside a run folder, never over an existing file
without ``overwrite``, and never counting one run twice."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from protofl.engine import runfolder
from protofl.errors import ProtoflError


def is_run_folder(p: Path) -> bool:
    return any((p / name).exists() for name in (runfolder.SUMMARY, runfolder.METRICS,
                                                 runfolder.CHECKPOINT))


def unique_runs(folders: Iterable[Path]) -> list[Path]:
    """The folders, refusing one that is given twice (compared by resolved path)."""
    seen: dict[Path, Path] = {}
    out = []
    for f in map(Path, folders):
        key = f.resolve()
        if key in seen:
            same = f"{f}" if str(seen[key]) == str(f) else f"{f} (and {seen[key]})"
            raise ProtoflError(f"run folder {same} is given twice; each run counts once")
        seen[key] = f
        out.append(f)
    return out


def check_targets(targets: Iterable[Path], runs: Iterable[Path], overwrite: bool) -> None:
    """Refuse, before anything is written, a target inside a run folder (given or not) or an
    existing one without ``overwrite``."""
    resolved_runs = {Path(r).resolve() for r in runs}
    for t in map(Path, targets):
        rt = t.resolve()
        for parent in rt.parents:
            if parent in resolved_runs or is_run_folder(parent):
                raise ProtoflError(f"{t} is inside the run folder {parent}: reports are never "
                                   "written into run folders; choose another --out")
        if rt.is_dir():
            raise ProtoflError(f"{t} is a folder; name a file")
        if rt.exists() and not overwrite:
            raise ProtoflError(f"{t} already exists; use --overwrite to replace it")


def _refusal(path: Path, e: OSError) -> ProtoflError:
    if isinstance(e, (FileExistsError, NotADirectoryError)):  # a folder on the way is a file
        return ProtoflError(f"cannot write {path}: a folder on its path is a file")
    return ProtoflError(f"cannot write {path}: {e.strerror or e}")


def write_bytes(path: Path, data: bytes) -> None:
    """Create the parent folders and write atomically; an OSError becomes one line."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        runfolder.atomic_write(path, data)
    except OSError as e:
        raise _refusal(path, e) from None


def write_text(path: Path, text: str) -> None:
    write_bytes(path, text.encode())


def write_json(path: Path, obj) -> None:
    write_text(path, json.dumps(runfolder.json_safe(obj), indent=2, ensure_ascii=False) + "\n")


def writable(path: Path) -> None:
    """Fail early, with one line, when ``path``'s folder cannot be created or written."""
    parent = Path(path).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _refusal(path, e) from None
    if not os.access(parent, os.W_OK):
        raise ProtoflError(f"cannot write {path}: permission denied")
