"""Named experiment grids (algorithms x datasets x seeds) run by ``protofl suite``.

Each suite is a list of (dataset label, base config) and a list of (run label, overrides);
every combination runs once per seed into ``OUT/<dataset>/<run>/seed<N>``, finished runs are
skipped (a killed suite resumes by running it again), and a comparison table and curves are
written at the end. A suite with ``ffd`` also runs the centralized baseline per dataset and
seed (``OUT/<dataset>/central/seed<N>``, before the others) as the reference model of the
FFD metric, which every other run then logs (``mmd``; the table's FFD against fedavg).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from protofl.config import ALPHA_SETTINGS, merge
from protofl.executor import execute, phases  # noqa: F401 (phases: the FFD references first)
from protofl.suite import Suite
from protofl.suites_hetero import HETERO_SUITES

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
OWN_LOCAL_WORK = {**OWN_OPTIMIZER, "batch_size": None, "local_steps": None}  # and its E, B


# the FFD reference of a suite: the centralized baseline (sequential: one client, no vmap)
CENTRAL = {"algorithm": "central", "trainer": "sequential"}


# the seed's federated segmentation benchmark on the embedded Shapes set (suite
# "segmentation"): 20 clients, Dirichlet(alpha) over the object class with power-law sizes,
# 48 px, the data's joint crop and flip, a DeepLab-V3+ of width 0.35 and 32 channels, and
# local work sized so the runs fit 15 minutes on 2 cores (docs/results.md). Each method
# samples clients its own way: fedavg uniformly (the seed's FedAvg), fedmargin in proportion
# to their size (its own setting); the labelled row fedavg-size-sampled is FedAvg with
# fedmargin's sampling, which isolates the weighting.
SHAPES_SEG = {
    "data": {"name": "shapes", "num_clients": 20, "partition": "dirichlet_powerlaw"},
    "model": {"width": 0.35, "seg_channels": 32},
    "rounds": 25,
    "eval_every": 5,
    "trainer": "sequential",  # 25% faster than vmap for this convnet on CPU
    "clients": {"per_round": 3, "local_steps": 8, "batch_size": 16, "optimizer": "adam",
                "lr": 0.003},
    "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 200},
}


def segmentation_figures(out: Path, work: list[tuple[dict, str]]) -> list[Path]:
    """The segmentation suite's figures: for each split the qualitative figure of the
    lowest seed's fedavg, fedmargin and central runs (``OUT/qualitative_<split>.png``) and
    the partition statistics of the three splits side by side (the seed's Fig. S1,
    ``OUT/partition.png``)."""
    from protofl.config import config_from_dict
    from protofl.data.registry import load_dataset
    from protofl.report.segmentation import partition_figure, runs_figure

    first: dict[tuple[str, str], tuple[int, str, dict]] = {}
    for raw, folder in work:
        parts = Path(folder).parts
        key, seed = (parts[-3], parts[-2]), raw["seed"]
        if key not in first or seed < first[key][0]:
            first[key] = (seed, folder, raw)
    central = [v for (ds, run), v in first.items() if run == "central"]
    written, splits = [], {}
    for ds in dict.fromkeys(ds for ds, _ in first):
        folders = {run: f for (d, run), (_, f, _) in first.items() if d == ds}
        if "central" not in folders and central:
            folders["central"] = min(central)[1]
        raw = first[(ds, "fedavg")][2]
        data = load_dataset(config_from_dict(raw).data, lean=True)  # its partition only
        splits[f"α = {raw['data']['alpha']:g}"] = data
        written.append(runs_figure(folders, out / f"qualitative_{ds}.png",
                                   title=f"{data.name}, α = {raw['data']['alpha']:g}"))
    written.append(partition_figure(splits, out / "partition.png"))
    return written


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
            # FedAvg as the seed means it: uniform sampling, n_k weights, stragglers dropped
            "1-fedavg": {"algorithm": "fedmargin", "algo": {"weights": "fedavg"},
                         "clients": {"tolerate_partial": False, "sampling": "uniform"}},
            # labelled ablation (not a row of the seed): FedAvg weights, size-weighted sampling
            "1b-fedavg-size-sampled": {"algorithm": "fedmargin", "algo": {"weights": "fedavg"},
                                       "clients": {"tolerate_partial": False,
                                                   "sampling": "weighted"}},
            # the fair policy under fedmargin's weighted sampling (row 2), then with i.i.d.
            # sampling (row 3: "comparable to FedAvg")
            "2-fairness": {"algorithm": "fedmargin", "algo": {"weights": "fair"},
                           "clients": {"tolerate_partial": False}},
            "3-fairness-iid-sampling": {"algorithm": "fedmargin", "algo": {"weights": "fair"},
                                        "clients": {"tolerate_partial": False,
                                                    "sampling": "uniform"}},
            "4-fedavg+toleration": {"algorithm": "fedmargin", "algo": {"weights": "fedavg"},
                                    "clients": {"tolerate_partial": True,
                                                "sampling": "uniform"}},
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
        "fedproin (its paper's Adam, lr 1e-4; and once more with its paper's batch 128 and "
        "E = 5 as well) vs fedavg, fedprox, moon, fedproto, fedtgp, fedplvm (Adam, lr 1e-3) "
        "on digits (K = 10, 5 per round), Dirichlet 0.5 and IID, 3 seeds",
        {"digits-dir0.5": merge(FEDPROIN_DIGITS, {"data": {"partition": "dirichlet",
                                                            "alpha": 0.5}}),
         "digits-iid": merge(FEDPROIN_DIGITS, {"data": {"partition": "iid"}})},
        {"fedproin": {"algorithm": "fedproin", "algo": {"flips": False},  # digits: no flips
                      "clients": OWN_OPTIMIZER},
         "fedproin-paper": {"algorithm": "fedproin", "algo": {"flips": False},
                            "clients": OWN_LOCAL_WORK},
         **{name: {"algorithm": name} for name in ("fedavg", "fedprox", "moon", "fedproto",
                                                     "fedtgp", "fedplvm")}},
    ),
    "segmentation": Suite(
        "fedavg (uniform sampling; and size-sampled as a labelled row) vs fedmargin and the "
        "centralized baseline on the embedded Shapes segmentation set, Dirichlet alpha = "
        "0.01, 0.1 and 1, 3 seeds: mIoU table, curves, qualitative and partition figures",
        {f"shapes-{name}": merge(SHAPES_SEG, {"data": {"alpha": a}})
         for name, a in ALPHA_SETTINGS.items()},
        {"fedavg": {"algorithm": "fedavg"}, "fedmargin": {"algorithm": "fedmargin"},
         # labelled ablation: FedAvg with fedmargin's size-weighted sampling
         "fedavg-size-sampled": {"algorithm": "fedavg", "clients": {"sampling": "weighted"}},
         "central": {"algorithm": "central"}},
        # the pooled data do not depend on alpha: the reference is trained once per seed
        runs_on={"central": ("shapes-a1",)},
        finish=segmentation_figures,
    ),
}


def seeded(raw: dict[str, Any], seed: int, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """``raw`` at run seed ``seed``: the partition (and generated data) follow the seed
    (``data.seed``), so a suite's seeds vary the partition too; ``overrides`` win."""
    return merge(merge(raw, {"seed": seed, "data": {"seed": seed}}), overrides or {})


def plan(name: str, out: Path, seeds: tuple[int, ...] | None = None,
         overrides: dict[str, Any] | None = None, added: tuple[str, ...] = ()
         ) -> list[tuple[dict, str]]:
    """Every (resolved raw config, run folder) of a suite; ``added``: algorithms (names,
    entry points or import paths) run as rows of their own beside the suite's."""
    from protofl.errors import ProtoflError

    if name not in SUITES:
        raise ProtoflError(f"unknown suite {name!r}; allowed: {', '.join(SUITES)}")
    suite = SUITES[name]
    runs, skip = suite.run_table(), not_run(name, overrides)
    for algorithm in added:
        label = re.sub(r"[^\w.-]", "_", algorithm)
        if label in runs:
            raise ProtoflError(f"--with {algorithm}: suite {name} already has a row {label!r}")
        runs = {**runs, label: {"algorithm": algorithm}}
    jobs = []
    for ds, base in suite.datasets.items():
        if ds in skip:
            continue
        for seed in seeds or suite.seeds:
            if suite.ffd:  # first, so that it runs before the runs that read it
                raw = seeded(merge(base, CENTRAL), seed, overrides)
                jobs.append((raw, str(out / ds / "central" / f"seed{seed}")))
        for label, over in runs.items():
            if ds not in suite.runs_on.get(label, (ds,)):
                continue
            for seed in seeds or suite.seeds:
                raw = seeded(merge(base, over), seed, overrides)
                if suite.ffd:
                    ref = (out / ds / "central" / f"seed{seed}").resolve()
                    raw = merge(raw, {"metrics": {"ffd_reference": str(ref)}})
                jobs.append((raw, str(out / ds / label / f"seed{seed}")))
    return jobs


def data_present(data: dict[str, Any]) -> bool:
    """Whether ``data.root`` holds what the loader of ``data.name`` reads (its layout check,
    ``data/sources.py``; without one: the folder exists)."""
    import importlib

    from protofl.data.sources import SOURCES
    from protofl.errors import ProtoflError

    root = data.get("root")
    if not root or not Path(str(root)).expanduser().exists():
        return False
    src = SOURCES.get(str(data.get("name")))
    if src is None or src.check is None:
        return True
    module, func = src.check.split(":")
    try:
        getattr(importlib.import_module(module), func)(Path(str(root)).expanduser())
    except ProtoflError:
        return False
    return True


def not_run(name: str, overrides: dict[str, Any] | None = None) -> dict[str, str]:
    """``{dataset label: "not run here: needs ..."}`` for the datasets of suite ``name`` whose
    data are absent (``Suite.needs``; ``overrides`` may move ``data.root``)."""
    suite = SUITES[name]
    out = {}
    for ds, what in suite.needs.items():
        data = merge(suite.datasets[ds], overrides or {}).get("data", {})
        if not data_present(data):
            out[ds] = f"not run here: needs {what} (data.root: {data.get('root')})"
    return out


def run_suite(name: str, out: Path, jobs: int | None = None, seeds: tuple[int, ...] | None = None,
              overrides: dict[str, Any] | None = None, added: tuple[str, ...] = (),
              executor: str = "local") -> str:
    """Run a suite (in ``jobs`` processes, or as Ray tasks: ``executor``,
    ``protofl/executor.py``) and write ``OUT/table.md``, the curves and ``OUT/report.html``;
    ``added``: algorithms run as rows of their own (:func:`plan`)."""
    from protofl.config import config_from_dict
    from protofl.errors import ProtoflError
    from protofl.report.compare import compare
    from protofl.report.html import write_html
    from protofl.report.sections import sections

    work = plan(name, out, seeds, overrides, added)
    for raw, _ in work:
        config_from_dict(raw)  # every config checked before anything runs
    skipped = not_run(name, overrides)
    notes = "".join(f"- {ds}: {why}\n" for ds, why in skipped.items())
    if not work:
        raise ProtoflError(f"suite {name}: nothing to run; " + "; ".join(
            f"{ds}: {why}" for ds, why in skipped.items()))
    execute(work, jobs, name, executor)
    text = compare([Path(f) for _, f in work], out / "table.md", overwrite=True)
    if notes:  # said on the terminal and under the table
        with open(out / "table.md", "a", encoding="utf-8") as f:
            f.write(f"\nDatasets not run:\n\n{notes}")
        text += f"\ndatasets not run:\n{notes}"
    finish = SUITES[name].finish
    figures = finish(out, work) if finish is not None else []
    write_html(sections([out]), out / "report.html", overwrite=True,
               title=f"protofl suite {name}")
    if figures:
        text += "\nfigures: " + ", ".join(str(f) for f in figures)
    return text

SUITES.update(HETERO_SUITES)  # the model-heterogeneous suites live in their own module
