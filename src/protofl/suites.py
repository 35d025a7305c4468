"""Named experiment grids (algorithms x datasets x seeds) run by ``protofl suite``.

Each suite is a list of (dataset label, base config) and a list of (run label, overrides);
every combination runs once per seed into ``OUT/<dataset>/<run>/seed<N>``, finished runs are
skipped (a killed suite resumes by running it again), and a comparison table and curves are
written at the end. A suite with ``ffd`` also runs the centralized baseline per dataset and
seed (``OUT/<dataset>/central/seed<N>``, before the others) as the reference model of the
FFD metric, which every other run then logs (``mmd``; the table's FFD against fedavg).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SYNTHETIC = {
    "data": {"name": "synthetic", "synthetic_alpha": 1.0, "synthetic_beta": 1.0},
    "rounds": 60,
    "clients": {"per_round": 10, "local_steps": 20, "batch_size": 10, "lr": 0.01,
                "stragglers": 0.5},
    "metrics": {"dissimilarity_clients": 30, "every": 1},  # per-round curves (small runs)
}
DIGITS_NONIID = {
    "data": {"name": "digits", "partition": "classes", "classes_per_client": 2,
             "num_clients": 30},
    "rounds": 40,
    "clients": {"per_round": 10, "local_steps": 20, "batch_size": 10, "lr": 0.05,
                "stragglers": 0.5},
    "metrics": {"dissimilarity_clients": 30, "every": 1},  # per-round curves (small runs)
}

# fedproin's protocol (K = 10, half active, Dirichlet 0.5 and IID) scaled to the digits CNN;
# the baselines share one local setup (momentum and weight decay pinned so that no baseline
# takes its own paper's), fedproin trains with its own optimizer and learning rate
FEDPROIN_DIGITS = {
    "data": {"name": "digits", "num_clients": 10},
    "rounds": 20,
    "clients": {"per_round": 5, "local_steps": 10, "batch_size": 32, "optimizer": "adam",
                "lr": 0.001, "momentum": 0.0, "weight_decay": 0.0},
    "metrics": {"dissimilarity_clients": 0},
}
OWN_OPTIMIZER = {"optimizer": None, "lr": None}  # null: the algorithm's paper setting


# the FFD reference of a suite: the centralized baseline (sequential: one client, no vmap)
CENTRAL = {"algorithm": "central", "trainer": "sequential"}


@dataclass
class Suite:
    description: str
    datasets: dict[str, dict[str, Any]]
    runs: dict[str, dict[str, Any]]
    seeds: tuple[int, ...] = (0, 1, 2)
    extra: list[str] = field(default_factory=list)
    ffd: bool = False  # a central reference per dataset and seed; FFD logged by every run


SUITES: dict[str, Suite] = {
    "main": Suite(
        "fedavg, fedprox, fedatt and fedmargin on Synthetic(1,1) and non-IID digits, 3 seeds, "
        "with FFD against a central model",
        {"synthetic": SYNTHETIC, "digits-noniid": DIGITS_NONIID},
        {"fedavg": {"algorithm": "fedavg"}, "fedprox": {"algorithm": "fedprox"},
         "fedatt": {"algorithm": "fedatt"}, "fedmargin": {"algorithm": "fedmargin"}},
        ffd=True,
    ),
    "fedmargin-options": Suite(
        "fedmargin's reconstruction alternatives (docs/algorithms.md) on the main job's data, "
        "3 seeds",
        {"synthetic": SYNTHETIC, "digits-noniid": DIGITS_NONIID},
        {"default": {"algorithm": "fedmargin"},
         "reduce-mean": {"algorithm": "fedmargin", "algo": {"reduce": "mean"}},
         "combine-product": {"algorithm": "fedmargin", "algo": {"combine": "product"}},
         "normalize-channel": {"algorithm": "fedmargin", "algo": {"normalize": "channel"}},
         "distance-cosine": {"algorithm": "fedmargin", "algo": {"distance": "cosine"}}},
    ),
    "fedmargin-ablation": Suite(
        "the seed's Table 3: every ablation row of fedmargin on Synthetic(1,1), 3 seeds",
        {"synthetic": SYNTHETIC},
        {
            "1-fedavg": {"algorithm": "fedmargin", "algo": {"weights": "fedavg"},
                         "clients": {"tolerate_partial": False, "sampling": "weighted"}},
            "2-fairness": {"algorithm": "fedmargin", "algo": {"weights": "fair"},
                           "clients": {"tolerate_partial": False}},
            "3-iid-sampling": {"algorithm": "fedmargin", "algo": {"weights": "fedavg"},
                               "clients": {"tolerate_partial": False, "sampling": "uniform"}},
            "4-fedavg+toleration": {"algorithm": "fedmargin", "algo": {"weights": "fedavg"},
                                    "clients": {"tolerate_partial": True}},
            "5-fairness+toleration": {"algorithm": "fedmargin", "algo": {"weights": "fair"},
                                      "clients": {"tolerate_partial": True}},
            "6-full-no-toleration": {"algorithm": "fedmargin",
                                     "clients": {"tolerate_partial": False}},
            "7-dplus-only": {"algorithm": "fedmargin", "algo": {"score": "dplus"}},
            "8-lpm-only": {"algorithm": "fedmargin", "algo": {"clues": "lpm"}},
            "9-apm-only": {"algorithm": "fedmargin", "algo": {"clues": "apm"}},
            "10-full": {"algorithm": "fedmargin"},
        },
    ),
    "fedproin": Suite(
        "fedproin (its paper's Adam, lr 1e-4) vs fedavg, fedprox, moon, fedproto, fedtgp, "
        "fedplvm (Adam, lr 1e-3) on digits (K = 10, 5 per round), Dirichlet 0.5 and IID, "
        "3 seeds",
        {"digits-dir0.5": {**FEDPROIN_DIGITS, "data": {**FEDPROIN_DIGITS["data"],
                                                       "partition": "dirichlet",
                                                       "alpha": 0.5}},
         "digits-iid": {**FEDPROIN_DIGITS, "data": {**FEDPROIN_DIGITS["data"],
                                                    "partition": "iid"}}},
        {"fedproin": {"algorithm": "fedproin", "algo": {"flips": False},  # digits: no flips
                      "clients": OWN_OPTIMIZER},
         **{name: {"algorithm": name} for name in ("fedavg", "fedprox", "moon", "fedproto",
                                                     "fedtgp", "fedplvm")}},
    ),
}


def _one(args: tuple[dict, str, bool]) -> str:
    raw, out, progress = args
    from protofl.api import run_experiment
    from protofl.config import config_from_dict

    # one thread and no worker processes of its own per suite process (the pool already uses
    # every core)
    run_experiment(config_from_dict({"threads": 1, "workers": 1, **raw}), Path(out),
                   overwrite=True, progress=progress)
    return out


def plan(name: str, out: Path, seeds: tuple[int, ...] | None = None,
         overrides: dict[str, Any] | None = None) -> list[tuple[dict, str]]:
    """Every (resolved raw config, run folder) of a suite."""
    from protofl.config import merge
    from protofl.errors import ProtoflError

    if name not in SUITES:
        raise ProtoflError(f"unknown suite {name!r}; allowed: {', '.join(SUITES)}")
    suite = SUITES[name]
    jobs = []
    for ds, base in suite.datasets.items():
        for seed in seeds or suite.seeds:
            if suite.ffd:  # first, so that it runs before the runs that read it
                raw = merge(merge(base, CENTRAL), {"seed": seed, **(overrides or {})})
                jobs.append((raw, str(out / ds / "central" / f"seed{seed}")))
        for label, over in suite.runs.items():
            for seed in seeds or suite.seeds:
                raw = merge(merge(base, over), {"seed": seed, **(overrides or {})})
                if suite.ffd:
                    ref = (out / ds / "central" / f"seed{seed}").resolve()
                    raw = merge(raw, {"metrics": {"ffd_reference": str(ref)}})
                jobs.append((raw, str(out / ds / label / f"seed{seed}")))
    return jobs


def phases(jobs: list[tuple[dict, str]]) -> list[list[tuple[dict, str]]]:
    """The jobs that other jobs read as their FFD reference, then the others."""
    refs = {Path(raw["metrics"]["ffd_reference"]).resolve() for raw, _ in jobs
            if raw.get("metrics", {}).get("ffd_reference")}
    first = [j for j in jobs if Path(j[1]).resolve() in refs]
    return [p for p in (first, [j for j in jobs if j not in first]) if p]


def run_suite(name: str, out: Path, jobs: int | None = None, seeds: tuple[int, ...] | None = None,
              overrides: dict[str, Any] | None = None) -> str:
    """Run a suite (in ``jobs`` processes) and write ``OUT/table.md``, the curves and
    ``OUT/report.html``."""
    from multiprocessing import get_context

    from protofl.config import config_from_dict
    from protofl.report.compare import compare
    from protofl.report.html import write_html
    from protofl.report.sections import sections

    work = plan(name, out, seeds, overrides)
    for raw, _ in work:
        config_from_dict(raw)  # every config checked before anything runs
    todo = [(raw, folder) for raw, folder in work if not (Path(folder) / "summary.json").exists()]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo) or 1))
    from tqdm import tqdm

    with tqdm(total=len(work), initial=len(work) - len(todo), unit="run", desc=name) as bar:
        if jobs == 1:
            for raw, folder in todo:
                _one((raw, folder, False))
                bar.update(1)
        else:
            with get_context("spawn").Pool(jobs) as pool:
                for phase in phases(todo):  # FFD references before the runs that read them
                    for _ in pool.imap_unordered(_one, [(r, f, False) for r, f in phase]):
                        bar.update(1)
    text = compare([Path(f) for _, f in work], out / "table.md", overwrite=True)
    write_html(sections([out]), out / "report.html", overwrite=True,
               title=f"protofl suite {name}")
    return text
