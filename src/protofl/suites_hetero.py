"""``protofl suite heterogeneous``: methods that train clients of different model families.

Two budgets. The default (``heterogeneous``) fits a 2-core machine in minutes: fedproto,
fedtgp and fedproin with clients of four model families against the same methods with one
shared model, Dirichlet(0.1), 3 seeds: the built-in digits (8x8), its 10 clients all active,
the ``htfe-cnn`` family (CNNs of 1, 2 and 3 conv blocks and a wide one; d = 128) against
every client training ``cnn2`` (the same engine path: one group), 20 rounds.

``--budget paper`` (``heterogeneous-paper``) is HtFLlib's protocol for model-heterogeneous FL
on CIFAR-10 and CIFAR-100 (github.com/TsingZ0/HtFLlib at commit e959261: ``system/main.py``'s
defaults, the run script ``system/total.sh`` and the data scripts it points to, PFLlib's
``dataset/generate_Cifar10.py``, ``generate_Cifar100.py`` and ``utils/dataset_utils.py``),
each value's source beside it, for EVERY method that trains heterogeneous models: the list
is read from the algorithm registry when the suite is planned (``engine.hetero.capable``), so
a method registered later joins it. 5 seeds. The CIFAR sets run where their data are
(where ``protofl data fetch cifar10`` / ``cifar100`` puts them: ``$PROTOFL_DATA``, else
``./data``), else each is reported "not run here"; the embedded ``cifar_tiny`` stands in
for them at a reduced budget that fits a 2-core machine (``STAND_IN`` below says how and why).
"""

from __future__ import annotations

from protofl.config import merge
from protofl.data.fetch import default_root
from protofl.suite import Runs, Suite

METHODS = ("fedproto", "fedtgp", "fedproin")  # the default budget's methods

SHORT = {  # the default budget: minutes on 2 cores
    "data": {"name": "digits", "num_clients": 10, "partition": "dirichlet", "alpha": 0.1},
    "rounds": 20,
    "eval_every": 5,
    "trainer": "vectorized",
    # local work as the FedTGP protocol (E = 1, B = 10, SGD) with lr 0.05 instead of 0.01,
    # so that 20 rounds of ~14 steps learn something on digits
    "clients": {"per_round": 10, "local_epochs": 1, "batch_size": 10, "optimizer": "sgd",
                "lr": 0.05, "momentum": 0.0, "weight_decay": 0.0},
    "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 0},
}


def _runs(family: str, shared: str, algo: dict[str, dict] | None = None) -> dict[str, dict]:
    runs = {}
    for m in METHODS:
        over = {"algorithm": m, "algo": (algo or {}).get(m, {})}
        runs[f"{m}-{family}"] = merge(over, {"model": {"family": family}})
        runs[f"{m}-shared-{shared}"] = merge(over, {"model": {"per_client": [shared]}})
    return runs


# ------------------------------------------------------------------ --budget paper: HtFLlib
# Sources: "main.py" = HtFLlib system/main.py's argparse defaults; "total.sh" = HtFLlib
# system/total.sh, its run script with "pre-tuned hyperparameters" (README), whose every line
# reads -t 3 -ab 1 -lr 0.01 -jr 1 -lbs 10 -ls 1 -nc 20 -ncl 100 -data Cifar100 -m HtFE-img-8
# -fd 512 (it shows CIFAR-100 only; CIFAR-10 takes the same values, -ncl 10, as the FedTGP
# repository's system/run_me.sh runs it: -data Cifar10 with the same flags); "PFLlib" =
# github.com/TsingZ0/PFLlib dataset/generate_Cifar10.py / generate_Cifar100.py and
# dataset/utils/dataset_utils.py, which HtFLlib's README names for making the data.
PROTOCOL = {
    "data": {
        "num_clients": 20,  # total.sh -nc 20; PFLlib generate_Cifar10/100.py num_clients = 20
        # PFLlib "noniid - dir" (HtFLlib README: label skew via a Dirichlet distribution),
        # dataset_utils.py alpha = 0.1
        "partition": "dirichlet", "alpha": 0.1,
        "local_test_fraction": 0.25,  # PFLlib dataset_utils.py train_ratio = 0.75 per client
        "augment": "none",  # PFLlib generate_*.py: ToTensor + Normalize only
    },
    "model": {"feature_dim": 512},  # total.sh -fd 512 (main.py default 512)
    # main.py --global_rounds 2000; total.sh adds -ab 1 (stop once 100 rounds, main.py's
    # --top_cnt, have passed without a new best test accuracy), which protofl does not do
    "rounds": 2000,
    "eval_every": 1,  # main.py --eval_gap 1
    "clients": {
        "per_round": 20,  # total.sh -jr 1 (join ratio 1: every client every round)
        "local_epochs": 1,  # total.sh -ls 1
        "batch_size": 10,  # total.sh -lbs 10
        # total.sh -lr 0.01; clients train with torch.optim.SGD(params, lr=...): no momentum,
        # no weight decay (main.py -ld False: no decay of the learning rate); one local
        # setup for every method, as HtFLlib's main.py gives every method the same
        "optimizer": "sgd", "lr": 0.01, "momentum": 0.0, "weight_decay": 0.0,
    },
    "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 0},
}
# total.sh -m HtFE-img-8: FedAvgCNN, GoogLeNet, MobileNetV2, ResNet-18/34/50/101/152, client
# k the model k mod 8 (docs/configuration.md: protofl's htfe-img-8 and how it differs)
CIFAR_MODEL = {"family": "htfe-img-8"}
# the data where `protofl data fetch` puts them ($PROTOFL_DATA, else ./data); -ncl 10 and
# -ncl 100 are the class counts, which protofl reads from the data
CIFAR10 = merge(PROTOCOL, {
    "data": {"name": "cifar10", "root": str(default_root() / "cifar10" / "cifar-10-batches-py")},
    "model": CIFAR_MODEL})
CIFAR100 = merge(PROTOCOL, {
    "data": {"name": "cifar100", "root": str(default_root() / "cifar100" / "cifar-100-python")},
    "model": CIFAR_MODEL})

# The stand-in: the embedded cifar_tiny (600 training and 200 test images, 32x32, 10
# classes) under the protocol's split and local training, at a REDUCED budget so that the
# whole suite (5 seeds x every method) fits about 40 minutes with 2 jobs on the 2-core build
# machine: its 55 runs took 36 min on 2026-12-04 (docs/results.md). What differs from the
# protocol, and why:
# - 10 clients (all active), not 20: 600 images cannot give 20 clients a Dirichlet(0.1)
#   share of at least 10 images each (4 of the seeds 0-4 fail to partition);
# - the matched harness's CNNs (benchmarks/hetero_vs_htfllib.py: client k trains cnn1,
#   cnn2, cnn3, cnn_wide by k mod 4) with d = 512, not an HtFLlib group: HtFLlib's cheapest
#   image group, htfe-img-2 (FedAvgCNN and ResNet-18), took 9x this family's time per
#   round with fedproto (htfe-img-4 12x), which would leave about 4 rounds per run;
# - ROUNDS_STAND_IN rounds instead of 2000, evaluated every 5 rounds instead of every one.
ROUNDS_STAND_IN = 40
STAND_IN = merge(PROTOCOL, {
    "data": {"name": "cifar_tiny", "num_clients": 10},
    "model": {"per_client": ["cnn1", "cnn2", "cnn3", "cnn_wide"]},
    "rounds": ROUNDS_STAND_IN,
    "eval_every": 5,
    "clients": {"per_round": 10},
})
PAPER_DATASETS = {"cifar10-dir0.1": CIFAR10, "cifar100-dir0.1": CIFAR100,
                  "cifar_tiny-dir0.1-reduced": STAND_IN}
PAPER_NEEDS = {
    "cifar10-dir0.1": "CIFAR-10's python batches (`protofl data fetch cifar10`) and a GPU",
    "cifar100-dir0.1": "CIFAR-100's python batches (`protofl data fetch cifar100`) and a GPU",
}

# total.sh's flags of each method, as protofl's options (protofl's name: HtFLlib's flags)
PAPER_ALGO: dict[str, dict] = {
    "fedproto": {"lam": 10.0},  # FedProto: -lam 10 (main.py default 1)
    "fedtgp": {"lam": 10.0, "server_epochs": 100, "margin_cap": 100.0},  # -lam 10 -se 100 -mart 100
    "fd": {"lam": 1.0},  # FD: -lam 1
    "fml": {"alpha": 0.5, "beta": 0.5},  # FML: -al 0.5 -bt 0.5
    "fedgh": {"server_lr": 0.01, "server_epochs": 1},  # FedGH: -slr 0.01 -se 1 (main.py -se 100)
    "lgfedavg": {},  # LG-FedAvg: none
    # FedKD: -mlr 0.01 (the mentee's lr: protofl trains both models with one optimizer at
    # the clients' 0.01) -Ts 0.95 -Te 0.98
    "fedkd": {"t_start": 0.95, "t_end": 0.98},
    # FedGen: -nd 32 -glr 0.1 -hd 512 -se 100, in HtFLlib's form (docs/algorithms.md, fedgen:
    # one regulariser at weight 1, no decay, no diversity term, a_k = n_k / n, its batch)
    "fedgen": {"noise_dim": 32, "server_lr": 0.1, "hidden": 512, "server_steps": 100,
               "alpha": 1.0, "beta": 0.0, "decay": 1.0, "eta": 0.0,
               "ensemble_weights": "samples", "server_batch": 10},
    "fedmrl": {"sub_dim": 128},  # FedMRL: -sfd 128
    # not HtFLlib's methods: the protocol's data and local training, their own options
    "fedproin": {}, "fpl": {},
}


def paper_runs() -> Runs:
    """One run per method able to train heterogeneous models, as registered now."""
    from protofl.engine.hetero import capable

    return {m: {"algorithm": m, "algo": PAPER_ALGO.get(m, {})} for m in capable()}


HETERO_SUITES: dict[str, Suite] = {
    "heterogeneous": Suite(
        "fedproto, fedtgp, fedproin with 4 model families (htfe-cnn) vs one shared model "
        "(cnn2) on digits, Dirichlet 0.1, 10 clients, 3 seeds (--budget paper: HtFLlib's "
        "CIFAR-10/100 protocol, every heterogeneous-capable method)",
        {"digits-dir0.1": SHORT}, _runs("htfe-cnn", "cnn2")),
    "heterogeneous-paper": Suite(
        "HtFLlib's model-heterogeneous protocol (20 clients, all active, Dirichlet 0.1, E = 1, "
        "B = 10, SGD lr 0.01, d = 512, HtFE-img-8, 2000 rounds) on CIFAR-10 and CIFAR-100 "
        "where their data are, and on cifar_tiny at a reduced budget; every method that "
        "trains heterogeneous models, 5 seeds",
        PAPER_DATASETS, paper_runs, seeds=(0, 1, 2, 3, 4), needs=PAPER_NEEDS),
}
BUDGETS = ("short", "paper")


def budget_name(name: str, budget: str | None) -> str:
    """The suite a ``--budget`` picks (``paper``: ``NAME-paper`` where there is one)."""
    from protofl.errors import ProtoflError

    if budget in (None, "short"):
        return name
    if f"{name}-{budget}" not in HETERO_SUITES:
        raise ProtoflError(f"suite {name!r} has no --budget {budget}")
    return f"{name}-{budget}"
