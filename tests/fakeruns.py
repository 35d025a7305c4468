"""Run folders written directly (no training), for fast tests of compare and report."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from protofl.algorithms.registry import algorithm_class
from protofl.config import config_from_dict, merge
from protofl.engine.spec import fill


def make_run(folder: Path, algorithm: str = "fedavg", seed: int = 0, rounds: int = 5,
             raw: dict | None = None, mmd: bool = False, weights: bool = False,
             accuracy: float = 0.5, paper_defaults: bool = False) -> Path:
    """A finished run folder with plausible, seed-dependent per-round figures."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    base = {"algorithm": algorithm, "seed": seed, "rounds": rounds,
            "data": {"name": "synthetic", "num_clients": 6}, "clients": {"per_round": 3}}
    cfg = config_from_dict(merge(base, raw or {}))
    # null local-training keys resolved to protofl's fallbacks (as if every run had set the
    # same ones), or with ``paper_defaults`` to the algorithm's, as a real run resolves them
    defaults = algorithm_class(algorithm).client_defaults if paper_defaults else {}
    cfg = dataclasses.replace(cfg, clients=fill(cfg.clients, defaults)).to_dict()
    (folder / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(seed + 17 * len(algorithm))
    rows = []
    for t in range(1, rounds + 1):
        r = {"round": t, "clients": [0, 1, 2], "accuracy": accuracy * t / rounds
             + 0.01 * rng.random(), "loss": 2.0 / t, "train_loss": 2.1 / t,
             "amm": 1.0 + 0.1 * t + 0.05 * rng.random(), "seconds": 0.5 * t,
             "client_accuracy": {str(k): 0.5 for k in range(6)}, "clients_evaluated": 6}
        if mmd:
            r["mmd"] = 0.2 / t + 0.01 * rng.random()
        if weights:
            w = rng.random(3) + 0.2
            r["weights"] = (w / w.sum()).tolist()
            r["fedavg_weights"] = [0.5, 0.3, 0.2]
        rows.append(r)
    rows[-1]["confusion"] = [[3, 1], [0, 4]]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    last = {k: v for k, v in rows[-1].items() if not isinstance(v, (list, dict))
            or k == "confusion"}
    summary = {"algorithm": algorithm, "dataset": "synthetic(1,1)", "seed": seed,
               "rounds": rounds, "trainer": "sequential", **last}
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder
