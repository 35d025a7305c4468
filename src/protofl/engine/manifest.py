"""A run folder's manifest: the SHA-256 of every file a resumed run, a report or a comparison
trusts, so a changed or corrupted file is refused with one line naming it.

``manifest.json`` records, for a run folder:

- ``config.json``: its digest and the settings it held (``settings``), so an edited file is
  refused naming the settings that differ;
- ``checkpoint.safetensors``: its digest and round, and the previous checkpoint's (a kill
  between the manifest's write and the checkpoint's rename leaves the previous one in place);
- ``metrics.jsonl``: the digest of its first ``bytes`` bytes, the lines up to the round of the
  last checkpoint (lines appended after it are dropped by a resume);
- ``summary.json`` and the per-round weights (``weights/round_*.safetensors``): their digests;
- ``history``: the settings changed on purpose when the run was resumed (``--rounds``,
  ``--device``, ``--set``), each with the round the run went on from.

The manifest is written atomically after the content it describes is on disk (a new file is
staged, the manifest written, then the file renamed into place). It guards against accidents
(a flipped bit, a hand edit, a truncated copy), not against someone who rewrites the manifest
too. A folder written before manifests existed (protofl 0.1) has none: it is read unchecked,
with a warning, and gets one at its next resume.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from protofl.errors import ProtoflError
from protofl.nested import flatten

MANIFEST = "manifest.json"
FORMAT = 1


def digest(data: bytes) -> dict:
    """``{"sha256": hex, "bytes": n}`` of ``data``."""
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def file_digest(path: Path, size: int | None = None) -> dict | None:
    """The digest of ``path``'s first ``size`` bytes (all of it when None); None when the file
    is missing or shorter than ``size``."""
    try:
        with open(path, "rb") as f:
            data = f.read() if size is None else f.read(size)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ProtoflError(f"{path} cannot be read: {e.strerror or e}") from None
    if size is not None and len(data) < size:
        return None
    return digest(data)


def new() -> dict:
    """An empty manifest (files are added as they are written)."""
    return {"format": FORMAT, "files": {}, "history": []}


def read(out: Path) -> dict | None:
    """``out``'s manifest; None when it has none (a folder written before manifests)."""
    path = Path(out) / MANIFEST
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        raise ProtoflError(f"{path} cannot be read: it is damaged, so the files of {out} "
                           "cannot be checked") from None
    if (not isinstance(manifest, dict) or manifest.get("format") != FORMAT
            or not isinstance(manifest.get("files"), dict)):
        raise ProtoflError(f"{path} is not a protofl manifest of a format this version reads")
    manifest.setdefault("history", [])
    return manifest


def encode(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=1, allow_nan=False) + "\n").encode()


def short(sha: str) -> str:
    return sha[:12]


def setting_changes(old: dict, new: dict) -> dict[str, list]:
    """The settings that differ between two configs: ``{dotted key: [old, new]}`` (a key one
    lacks has None)."""
    a, b = flatten(old), flatten(new)
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def said(changes: dict[str, list], most: int = 3) -> str:
    """``clients.lr 0.01 -> 0.5, data.num_clients 5 -> 7`` (the first ``most``, then a count)."""
    parts = [f"{k} {json.dumps(a)} -> {json.dumps(b)}" for k, (a, b) in changes.items()]
    more = f" and {len(parts) - most} more" if len(parts) > most else ""
    return ", ".join(parts[:most]) + more


def _config_problem(out: Path, name: str, entry: dict) -> str | None:
    found = file_digest(out / name)
    if found is None:
        return f"{name} is missing (manifest.json records it)"
    if found["sha256"] == entry["sha256"]:
        return None
    try:
        now = json.loads((out / name).read_bytes())
    except ValueError:
        return f"{name} was changed after it was written: it is no longer valid JSON"
    changes = setting_changes(entry["settings"], now if isinstance(now, dict) else {})
    if not changes:
        return None  # rewritten with the same settings (reformatted): nothing differs
    return (f"{name} was changed after the run wrote it: {said(changes)} (the run used the "
            "left-hand values); restore it, or change settings on purpose with "
            "`protofl run --resume DIR --set KEY=VALUE`, which the run's history records")


def _file_problem(out: Path, name: str, entry: dict) -> str | None:
    accepted = [entry, *([entry["previous"]] if entry.get("previous") else [])]
    prefix = bool(entry.get("prefix"))
    found = file_digest(out / name, entry["bytes"] if prefix else None)
    if found is None:
        if not (out / name).exists():
            return f"{name} is missing (manifest.json records it)"
        have = (out / name).stat().st_size
        return (f"{name} is shorter than the {entry['bytes']} bytes written up to round "
                f"{entry['round']} ({have} found): lines were cut or edited")
    if any(found["sha256"] == e["sha256"] for e in accepted):
        return None
    if prefix:
        what = f"{name}: its lines up to round {entry['round']} differ from those"
    elif "round" in entry:
        what = f"{name} differs from round {entry['round']}'s checkpoint"
    else:
        what = f"{name} differs from the file"
    size = ("" if prefix else "; same size" if any(found["bytes"] == e["bytes"] for e in accepted)
            else f"; {found['bytes']} bytes, {entry['bytes']} written")
    return (f"{what} protofl wrote (SHA-256 {short(entry['sha256'])}… recorded, "
            f"{short(found['sha256'])}… found{size}): it was changed or corrupted after it "
            "was written")


def problems(out: Path, manifest: dict) -> list[str]:
    """What in ``out`` differs from ``manifest``, one line each (empty: everything matches)."""
    out = Path(out)
    found = []
    for name, entry in sorted(manifest["files"].items()):
        problem = (_config_problem if "settings" in entry else _file_problem)(out, name, entry)
        if problem:
            found.append(problem)
    return found


def history_lines(manifest: dict) -> list[str]:
    """The settings changed on resume, one line each: ``after round 2: clients.lr 0.01 ->
    0.5``."""
    return [f"after round {h['round']}: {said(h['changed'], most=20)}"
            for h in manifest.get("history", [])]
