"""Reading a SuperNode's audit log (``protofl audit LOG``): what a site sent, message by
message, as ``flower/node.py:AuditLog`` wrote it (names, shapes and types, never values).
Imports no flwr, so a site's auditor needs only protofl."""

from __future__ import annotations

import json
from pathlib import Path

from protofl.errors import ProtoflError

KINDS = ("query", "train", "evaluate")


def read(path: Path) -> list[dict]:
    """The lines of one audit log, each checked to be what ``AuditLog.write`` writes."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ProtoflError(f"{path} cannot be read: {getattr(e, 'strerror', None) or e}"
                           ) from None
    lines = []
    for i, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            raise ProtoflError(f"{path}:{i} is not valid JSON: not a protofl audit log"
                               ) from None
        if (not isinstance(line, dict) or line.get("message") not in KINDS
                or not isinstance(line.get("entries"), dict)):
            raise ProtoflError(f"{path}:{i} is not an audit line (message and entries)")
        lines.append(line)
    return lines


def logs(paths: list[Path]) -> list[Path]:
    """The audit logs given: files, or the ``run*-partition*.jsonl`` in folders."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            inside = sorted(p.glob("run*-partition*.jsonl"))
            if not inside:
                raise ProtoflError(f"{p} holds no audit log (run<R>-partition<K>.jsonl)")
            found += inside
        elif p.is_file():
            found.append(p)
        else:
            raise ProtoflError(f"{p}: no such audit log or folder")
    return found


def entry(name: str, what) -> str:
    """``upload.protos float32[10, 5]``, ``loss float``."""
    if isinstance(what, list) and len(what) == 2:
        shape, dtype = what
        return f"{name} {dtype}{list(shape)}"
    return f"{name} {what}"


def describe(path: Path, lines: list[dict]) -> list[str]:
    """One header line for the log, then one line per message it sent."""
    counts = {k: sum(x["message"] == k for x in lines) for k in KINDS}
    head = (f"{path}: {len(lines)} messages sent ("
            + ", ".join(f"{k} {n}" for k, n in counts.items() if n)
            + "); names, shapes and types only, never values")
    out = [head]
    for x in lines:
        how = [w for w, on in (("secure sum", x.get("secure")), ("noised", x.get("noised")))
               if on]
        rnd = "-" if x.get("round") is None else str(x["round"])
        out.append(f"  {x.get('time', '?')}  {x['message']:8s} round {rnd:>3s}"
                   + (f"  [{', '.join(how)}]" if how else "") + ": "
                   + ", ".join(entry(k, v) for k, v in x["entries"].items()))
    return out


def report(paths: list[Path]) -> str:
    """``protofl audit``: every log under ``paths``, described."""
    return "\n".join(line for p in logs(paths) for line in describe(p, read(p)))
