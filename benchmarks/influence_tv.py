"""How far fedproin's per-prototype aggregation weights move between the two influence counts.

One fedproin run (digits, K = 10 clients, 5 active a round, Dirichlet alpha = 0.5 by default,
fedproin's paper defaults for local training unless ``--set`` says otherwise) counts influence
over the last local epoch as trained (``algo.influence: last_epoch``). After each aggregation
a callback recounts the same uploads the other way (``final``: every training sample once,
unaugmented, with the final local weights) and, for every prototype (c, m) some client hit in
both counts, takes the total-variation distance between the two aggregation-weight vectors
over the round's clients, ``TV = 1/2 sum_k |I_k / sum I - I'_k / sum I'|``. Printed: the
median, quartiles and mean over rounds and prototypes, and the same for a class-level view
(influence summed over m). Both counts come from the same trajectory, so the figure isolates
the counting rule. A third line is the label-level bound of a trained model (every sample's
nearest prototype of its own class): class weights ``n_{k,c}`` (final count) against the
expected class-balanced draws, ``max_c' n_{k,c'}`` for every class the client holds.

    python benchmarks/influence_tv.py                       # ~1 min on 2 cores
    python benchmarks/influence_tv.py --set algo.prototypes_per_class=1 --rounds 20
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from protofl.algorithms import prototype_math
from protofl.algorithms.base import features
from protofl.config import apply_set, config_from_dict
from protofl.engine.callbacks import Callback
from protofl.engine.experiment import Experiment


def tv_rows(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """TV distance between the columns of ``a`` and ``b`` (``(K, P)`` counts) normalised over
    K, for the columns with a positive total in both."""
    a, b = a.double(), b.double()
    ok = (a.sum(0) > 0) & (b.sum(0) > 0)
    pa, pb = a[:, ok] / a[:, ok].sum(0), b[:, ok] / b[:, ok].sum(0)
    return (0.5 * (pa - pb).abs().sum(0)).numpy()


class InfluenceTV(Callback):
    """Recounts each round's uploads with the final weights and records the TV distances."""

    def __init__(self) -> None:
        self.prototype: list[float] = []
        self.classes: list[float] = []
        self.ideal: list[float] = []

    def after_aggregate(self, exp, record, results):
        alg = exp.alg
        last, final, held = [], [], []
        for r in results:
            x, y = exp.client_inputs(r.client)
            held.append(torch.bincount(y, minlength=exp.data.num_classes).double())
            protos = r.upload["params"]["prototypes"]
            z = features(alg.model, r.upload["params"], r.upload["buffers"], x)
            final.append(prototype_math.nearest_prototype_counts(z.to(protos.dtype), protos))
            last.append(r.upload["influence"])
        a, b = torch.stack(last), torch.stack(final)  # (K, C, M)
        self.prototype += tv_rows(a.flatten(1), b.flatten(1)).tolist()
        self.classes += tv_rows(a.sum(2), b.sum(2)).tolist()
        n = torch.stack(held)  # (K, C) n_{k,c}
        draws = (n > 0) * n.max(dim=1, keepdim=True).values
        self.ideal += tv_rows(draws, n).tolist()


def summary(name: str, values: list[float]) -> str:
    v = np.asarray(values)
    q1, med, q3 = np.percentile(v, [25, 50, 75])
    return (f"{name}: median TV {med:.3f} (quartiles {q1:.3f}-{q3:.3f}), mean {v.mean():.3f}, "
            f"n = {len(v)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args()
    torch.set_num_threads(1)
    raw = {"algorithm": "fedproin", "rounds": a.rounds, "seed": a.seed, "checkpoint_every": 0,
           "data": {"name": "digits", "num_clients": 10, "partition": "dirichlet",
                    "alpha": 0.5},
           "clients": {"per_round": 5},
           "metrics": {"dissimilarity_clients": 0, "amm": False, "train_loss_samples": 0},
           "algo": {"flips": False, "influence": "last_epoch"}}
    for s in a.set:
        apply_set(raw, s)
    tv = InfluenceTV()
    exp = Experiment(config_from_dict(raw), callbacks=[tv])
    exp.run()
    c = exp.cfg.clients
    print(f"fedproin, digits, {exp.data.num_clients} clients, partition {exp.cfg.data.partition}"
          f" (alpha {exp.cfg.data.alpha}), {c.per_round} a round, {exp.cfg.rounds} rounds, "
          f"M = {exp.cfg.algo['prototypes_per_class']}, {c.optimizer} lr {c.lr}, batch "
          f"{c.batch_size}, " + (f"{c.local_steps} steps" if c.local_steps else
                                  f"E = {c.local_epochs}"))
    print(summary("per prototype (c, m)", tv.prototype))
    print(summary("per class (summed over m)", tv.classes))
    print(summary("per class, ideal assignment (n_k,c vs balanced draws)", tv.ideal))


if __name__ == "__main__":
    main()
