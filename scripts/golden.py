"""The golden matrix: tiny runs over the paths a refactor touches, hashed.

    PYTHONPATH=src python3 scripts/golden.py OUT.json

Each run writes a run folder through the public API (``protofl.run_experiment`` /
``resume_experiment``, ``trainer: sequential``); its hash is that of ``metrics.jsonl`` minus
the timing keys, and of the final checkpoint's server state, client states and torch
generator. A refactor that keeps every number keeps every hash.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch

import protofl
from protofl.config import config_from_dict, merge
from protofl.engine import runfolder
from protofl.engine.callbacks import Callback

TIMING = {"seconds"}
BASE = {"rounds": 4, "checkpoint_every": 2, "seed": 1, "trainer": "sequential", "threads": 1,
        "data": {"name": "digits", "num_clients": 6},
        "clients": {"per_round": 3, "local_steps": 2, "batch_size": 16},
        "metrics": {"dissimilarity_clients": 2, "train_loss_samples": 40}}
SEG = {"data": {"name": "shapes", "image_size": 16, "num_clients": 4, "max_samples": 80},
       "model": {"width": 0.25, "seg_channels": 8}, "rounds": 2,
       "clients": {"per_round": 2, "local_steps": 2, "batch_size": 4},
       "metrics": {"dissimilarity_clients": 2, "train_loss_samples": 20, "eval_batch": 16}}
DP = {"privacy": {"noise_multiplier": 0.5, "clip": 1.0, "reproducible_noise": True}}
RUNS = {
    "fedavg": {"algorithm": "fedavg"},
    "fedmargin": {"algorithm": "fedmargin"},
    "fedproin": {"algorithm": "fedproin"},
    "moon": {"algorithm": "moon"},
    "fedproto": {"algorithm": "fedproto", "eval_every": 2},
    "dp_fedavg": {"algorithm": "fedavg", **DP},
    "dp_fedavg_client": {"algorithm": "fedavg", "privacy": {**DP["privacy"], "noise": "client"}},
    "dp_fedproin": {"algorithm": "fedproin", **DP},
    "dp_budget": {"algorithm": "fedavg",
                  "privacy": {**DP["privacy"], "noise_multiplier": 1.0, "budget": 30.0}},
    "secagg_fedavg": {"algorithm": "fedavg", "privacy": {"secagg": True}},
    "hetero_fedproto": {"algorithm": "fedproto", "model": {"per_client": ["cnn1", "mlp"]},
                        "clients": {"per_round": 6}},
    "seg_fedmargin": {"algorithm": "fedmargin", **SEG},
}
RESUMED = ("fedmargin", "dp_fedavg", "fedproin")  # also killed after round 2 and resumed


class Kill(Callback):
    def __init__(self, at: int):
        self.at = at

    def on_round_end(self, *args):
        record = next(a for a in args if isinstance(a, dict))
        if record["round"] == self.at:
            raise KeyboardInterrupt


def digest(obj) -> str:
    h = hashlib.sha256()

    def walk(x, key=""):
        if isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k], f"{key}.{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{key}[{i}]")
        elif isinstance(x, torch.Tensor):
            h.update(key.encode())
            h.update(str(x.dtype).encode() + str(tuple(x.shape)).encode())
            h.update(x.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
                     if x.numel() else b"")
        else:
            h.update(f"{key}={x!r}".encode())

    walk(obj)
    return h.hexdigest()[:16]


def hashes(out: Path) -> dict:
    rows = [{k: v for k, v in r.items() if k not in TIMING} for r in runfolder.read_metrics(out)]
    snap = runfolder.load_checkpoint(out)
    return {"metrics": digest(rows), "state": digest(snap["state"]),
            "client_states": digest(snap["client_states"]), "rng": digest(snap["torch_rng"]),
            "rounds": len(rows), "last": {k: rows[-1].get(k) for k in ("accuracy", "epsilon")}}


def main(path: str, only: list[str]) -> None:
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, over in RUNS.items():
            if only and name not in only:
                continue
            cfg = config_from_dict(merge(BASE, over))
            out = Path(tmp) / name
            protofl.run_experiment(cfg, out)
            result[name] = hashes(out)
            if name in RESUMED:
                out2 = Path(tmp) / (name + "_resumed")
                try:
                    protofl.run_experiment(cfg, out2, callbacks=[Kill(2)])
                except KeyboardInterrupt:
                    pass
                protofl.resume_experiment(out2)
                result[name + "_resumed"] = hashes(out2)
                assert {k: v for k, v in result[name + "_resumed"].items() if k != "rng"} == {
                    k: v for k, v in result[name].items() if k != "rng"}, name
            print(name, result[name], flush=True)
    Path(path).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
