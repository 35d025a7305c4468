"""What a run was made with: the versions of protofl, torch, flwr and Python, and the git
commit when protofl runs from a checkout (``summary.json``'s ``provenance``)."""

from __future__ import annotations

import functools
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any


def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def git_commit(where: Path) -> dict[str, Any] | None:
    """``{"commit", "dirty"}`` of the git checkout holding ``where``, else None."""
    try:
        run = functools.partial(subprocess.run, cwd=where, capture_output=True, text=True,
                                timeout=5, check=True)
        commit = run(["git", "rev-parse", "HEAD"]).stdout.strip()
        dirty = bool(run(["git", "status", "--porcelain", "--untracked-files=no"]).stdout)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


@functools.lru_cache(maxsize=1)
def provenance() -> dict[str, Any]:
    """The run's provenance (computed once per process)."""
    out: dict[str, Any] = {"protofl": version("protofl"), "torch": version("torch"),
                           "flwr": version("flwr"), "python": platform.python_version()}
    git = git_commit(Path(__file__).resolve().parent)
    if git is not None:
        out["git"] = git
    return out
