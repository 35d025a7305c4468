"""A run folder: config.json, metrics.jsonl, summary.json, checkpoint.pt, plots.

Writes are atomic (a temporary file, then a rename), so a killed run never leaves a torn file.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from protofl.errors import ProtoflError

CONFIG, METRICS, SUMMARY = "config.json", "metrics.jsonl", "summary.json"
CHECKPOINT = "checkpoint.pt"


def _clean(obj: Any) -> Any:
    """JSON-safe: NaN/Inf become null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, (json.dumps(_clean(obj), indent=2) + "\n").encode())


def prepare(out: Path, overwrite: bool) -> None:
    """Create the folder; refuse to touch an existing run unless ``overwrite``."""
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ProtoflError(f"run folder {out} already holds a run; use --resume to continue "
                               "it, --overwrite to replace it, or another --out")
        for name in (CONFIG, METRICS, SUMMARY, CHECKPOINT):
            (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)


def append_metrics(out: Path, record: dict) -> None:
    with open(out / METRICS, "a") as f:
        f.write(json.dumps(_clean(record)) + "\n")
        f.flush()


def read_metrics(folder: Path) -> list[dict]:
    path = Path(folder) / METRICS
    if not path.exists():
        raise ProtoflError(f"{folder} is not a run folder (no {METRICS})")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise ProtoflError(f"{path}:{i} is not valid JSON") from None
    return rows


def truncate_metrics(out: Path, last_round: int) -> None:
    """Drop metric lines past the checkpoint (they are recomputed on resume)."""
    path = out / METRICS
    if path.exists():
        keep = [r for r in read_metrics(out) if r["round"] <= last_round]
        atomic_write(path, "".join(json.dumps(_clean(r)) + "\n" for r in keep).encode())


def save_checkpoint(out: Path, payload: dict) -> None:
    tmp = out / (CHECKPOINT + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, out / CHECKPOINT)


def load_checkpoint(out: Path) -> dict:
    path = out / CHECKPOINT
    if not path.exists():
        raise ProtoflError(f"{out} has no {CHECKPOINT} to resume from")
    try:
        return torch.load(path, weights_only=False)
    except Exception as e:  # a torn or foreign file
        raise ProtoflError(f"{path} cannot be read: {type(e).__name__}") from None


def load_config_json(out: Path) -> dict:
    path = out / CONFIG
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        raise ProtoflError(f"{out} has no readable {CONFIG}") from None
