"""``protofl suite heterogeneous``: fedproto, fedtgp and fedproin with clients of four model
families against the same methods with one shared model, Dirichlet(0.1), 3 seeds.

Two budgets. The default (``heterogeneous``) fits a 2-core machine in minutes: the built-in
digits (8x8), its 10 clients all active, the ``htfe-cnn`` family (CNNs of 1, 2 and 3 conv
blocks and a wide one; d = 128) against every client training ``cnn2`` (the same engine path:
one group), 20 rounds. ``--budget paper`` (``heterogeneous-paper``) is the FedTGP paper's
protocol as its authors' run script gives it (HtFLlib ``system/total.sh``, FedTGP lines: -nc
20 -jr 1 -lbs 10 -ls 1 -lr 0.01 -fd 512 -lam 10 -se 100 -mart 100; Dirichlet 0.1 is
HtFLlib's default label-skew split), with the ``htfe-img`` family (a CNN, MobileNetV2,
ResNet-18, a 3-block CNN) in place of HtFE-img-8, on digits until a CIFAR set is at hand
(``--set data.name=...``).
"""

from __future__ import annotations

from protofl.config import merge
from protofl.suite import Suite

METHODS = ("fedproto", "fedtgp", "fedproin")

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
PAPER = {  # FedTGP (Zhang et al., AAAI 2024), as its authors' HtFLlib run script sets it
    "data": {"name": "digits", "num_clients": 20,  # -nc 20
             "partition": "dirichlet", "alpha": 0.1},  # HtFLlib's label skew, Dir(0.1)
    # HtFLlib main.py: --global_rounds 2000 (its run script adds -ab 1: stop after 100 rounds
    # without a new best, which protofl does not do)
    "rounds": 2000,
    "clients": {"per_round": 20,  # -jr 1: every client every round
                "local_epochs": 1, "batch_size": 10, "optimizer": "sgd",  # -ls 1, -lbs 10
                "lr": 0.01, "momentum": 0.0, "weight_decay": 0.0},  # -lr 0.01
    "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 0},
}
# -lam 10 for FedProto and FedTGP, -se 100 -mart 100 for FedTGP (protofl's fedtgp defaults)
PAPER_ALGO = {"fedproto": {"lam": 10.0}, "fedtgp": {}, "fedproin": {}}


def _runs(family: str, shared: str, algo: dict[str, dict] | None = None) -> dict[str, dict]:
    runs = {}
    for m in METHODS:
        over = {"algorithm": m, "algo": (algo or {}).get(m, {})}
        runs[f"{m}-{family}"] = merge(over, {"model": {"family": family}})
        runs[f"{m}-shared-{shared}"] = merge(over, {"model": {"per_client": [shared]}})
    return runs


HETERO_SUITES: dict[str, Suite] = {
    "heterogeneous": Suite(
        "fedproto, fedtgp, fedproin with 4 model families (htfe-cnn) vs one shared model "
        "(cnn2) on digits, Dirichlet 0.1, 10 clients, 3 seeds (--budget paper: the FedTGP "
        "protocol)",
        {"digits-dir0.1": SHORT}, _runs("htfe-cnn", "cnn2")),
    "heterogeneous-paper": Suite(
        "the FedTGP paper's protocol (20 clients, all active, Dirichlet 0.1, E = 1, B = 10, "
        "lr 0.01, d = 512): fedproto, fedtgp, fedproin with htfe-img vs one shared cnn2",
        {"digits-dir0.1-paper": PAPER}, _runs("htfe-img", "cnn2", PAPER_ALGO)),
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
