"""What a SuperNode decides for itself (docs/flower.md, "A site's own settings").

- :func:`node_config_json`: the run's config as this node builds it: the server's
  ``callbacks`` and trackers are dropped (a node imports nothing the server names), and the
  node's own ``device``, ``threads`` and ``eval-batch`` replace the server's; a device the
  node lacks falls back to the CPU with a log line.
- :func:`check_versions`: the protofl minor and torch major versions the server sent must be
  this node's, and the config must be the one its hash names; else one line (an error reply
  the server logs, and the node is left out).
- :class:`AuditLog`: one JSON line per message the node sends (round, keys, shapes, dtypes,
  whether secure / noised) in its own folder (``audit-dir``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import time
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.common.logger import log

from protofl import plugins
from protofl.errors import ProtoflError
from protofl.nested import flatten

# node-config keys (``flower-supernode --node-config``)
DEVICE, THREADS, EVAL_BATCH = "device", "threads", "eval-batch"
AUDIT_DIR = "audit-dir"  # this node's audit log folder ("off": none)
AUDIT_ENV = "PROTOFL_AUDIT_DIR"  # the default folder when the node config names none
AUDIT_DEFAULT = "protofl-audit"  # ... else this folder in the SuperNode's working folder
SERVER_ONLY = ("callbacks", "tracking", "tracking_dir")  # run on the server, never here
# keys of the versions record the ServerApp sends with every query and job
PROTOFL_VERSION, TORCH_VERSION, CONFIG_HASH = "protofl-version", "torch-version", "config-hash"
VERSIONS_RECORD = "versions"  # the ConfigRecord holding them


def protofl_version() -> str:
    try:
        return importlib.metadata.version("protofl")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def config_hash(cfg_json: str) -> str:
    return hashlib.sha256(cfg_json.encode()).hexdigest()[:16]


def versions(cfg_json: str) -> dict[str, str]:
    """What the ServerApp sends so a node can check it runs the same software and config."""
    return {PROTOFL_VERSION: protofl_version(), TORCH_VERSION: torch.__version__,
            CONFIG_HASH: config_hash(cfg_json)}


def _release(version: str, parts: int) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:parts])


def check_versions(sent: Any, cfg_json: str | None = None) -> None:
    """One ProtoflError line when the server's protofl minor version, torch major version or
    config hash (of ``cfg_json``) are not this node's; a server that sent none is refused."""
    if sent is None or PROTOFL_VERSION not in sent or TORCH_VERSION not in sent:
        raise ProtoflError("flower: the server sent no protofl/torch version; it runs an "
                           f"older protofl than this node's {protofl_version()}")
    mine, theirs = protofl_version(), str(sent[PROTOFL_VERSION])
    if _release(mine, 2) != _release(theirs, 2):
        raise ProtoflError(f"flower: version mismatch: the server runs protofl {theirs}, this "
                           f"node {mine}; install the same minor version on both")
    if _release(torch.__version__, 1) != _release(str(sent[TORCH_VERSION]), 1):
        raise ProtoflError(f"flower: version mismatch: the server runs torch "
                           f"{sent[TORCH_VERSION]}, this node {torch.__version__}; install "
                           "the same major version on both")
    if cfg_json is not None and str(sent.get(CONFIG_HASH, "")) != config_hash(cfg_json):
        raise ProtoflError("flower: the run's config does not match the hash the server sent "
                           "(corrupted or altered on the way)")


def _device(wanted: str) -> str:
    """``wanted``, or the CPU (logged) when this node has no such device."""
    kind = wanted.split(":")[0]
    has = {"cuda": torch.cuda.is_available(),
           "mps": bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())}
    if kind == "cuda" and has["cuda"] and ":" in wanted:
        has["cuda"] = int(wanted.split(":")[1]) < torch.cuda.device_count()
    if kind in has and not has[kind]:
        log(WARNING, "protofl: device %s is not available on this node; training on the CPU",
            wanted)
        return "cpu"
    return wanted


def node_config_json(cfg_json: str, node_config: Any) -> str:
    """The run's config as this node builds it (JSON): no server-side callbacks or trackers,
    and this node's own device, threads and evaluation batch."""
    raw = json.loads(cfg_json)
    used = {k: v for k, v in (raw.get("plugins") or {}).items()  # what this node loads
            if not k.startswith(SERVER_ONLY)}
    plugins.check(used, installed_only=True)  # no code the server merely names
    dropped = [k for k in SERVER_ONLY if raw.get(k)]
    if dropped:
        log(INFO, "protofl: %s run on the server only; not loaded here", ", ".join(dropped))
    raw.update({"callbacks": [], "tracking": [], "tracking_dir": None})
    try:
        if node_config.get(THREADS) not in (None, ""):
            raw["threads"] = int(node_config[THREADS])
        if node_config.get(EVAL_BATCH) not in (None, ""):
            raw.setdefault("metrics", {})["eval_batch"] = int(node_config[EVAL_BATCH])
    except (TypeError, ValueError) as e:
        raise ProtoflError(f"flower: node config {THREADS} / {EVAL_BATCH} must be integers "
                           f"({e})") from None
    raw["device"] = _device(str(node_config.get(DEVICE) or raw.get("device", "auto")))
    return json.dumps(raw, sort_keys=True)


def _describe(tree: Any) -> dict[str, Any]:
    """Key -> [shape, dtype] of every leaf (tensors, arrays), or the value's type."""
    out: dict[str, Any] = {}
    for k, v in (flatten(tree) if isinstance(tree, dict) else dict(enumerate(tree))).items():
        if isinstance(v, (torch.Tensor, np.ndarray)):
            out[str(k)] = [list(v.shape), str(v.dtype).removeprefix("torch.")]
        else:
            out[str(k)] = type(v).__name__
    return out


class AuditLog:
    """This node's record of what it sent: ``<audit-dir>/run<R>-partition<K>.jsonl``, one
    JSON line per reply (``audit-dir`` from the node config, else $PROTOFL_AUDIT_DIR, else
    ``protofl-audit`` in the working folder; ``off``: none)."""

    def __init__(self, node_config: Any, run_id: int, partition: int):
        folder = str(node_config.get(AUDIT_DIR) or os.environ.get(AUDIT_ENV) or AUDIT_DEFAULT)
        self.path = (None if folder == "off"
                     else Path(folder).expanduser() / f"run{run_id}-partition{partition}.jsonl")

    def write(self, kind: str, round: int | None, sent: Any, *, secure: bool = False,
              noised: bool = False) -> None:
        """One line for one message: what it held (keys, shapes, dtypes), never values."""
        if self.path is None:
            return
        line = {"time": round_time(), "message": kind, "round": round, "secure": secure,
                "noised": noised, "entries": _describe(sent)}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as e:
            raise ProtoflError(f"flower: cannot write the audit log {self.path}: {e}") from None


def round_time() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
