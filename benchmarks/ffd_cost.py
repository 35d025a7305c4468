"""What the per-round FFD metric costs: the client-averaged MMD² of K' client models against
a reference model on a fixed probe set (one forward pass per model and one cdist per
client), next to one ordinary round of the same run.

Method: the main suite's non-IID digits setting (30 clients, 10 per round, 20 local steps);
two warm-up rounds, then ``--rounds`` timed rounds of ``Experiment.step`` and the same
number of ``mean_client_mmd`` calls with the round's 10 client models (random stand-ins of
the same architecture) and a reference, for each probe size. One torch thread.
"""

from __future__ import annotations

import argparse
import time

import torch

from protofl.config import config_from_dict
from protofl.engine.experiment import Experiment
from protofl.metrics.mmd import mean_client_mmd, probe_indices


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--probes", default="128,256,512")
    args = ap.parse_args()
    torch.set_num_threads(1)
    exp = Experiment(config_from_dict({
        "algorithm": "fedavg", "rounds": 100,
        "data": {"name": "digits", "partition": "classes", "classes_per_client": 2,
                 "num_clients": 30},
        "clients": {"per_round": 10, "local_steps": 20, "batch_size": 10, "lr": 0.05},
        "metrics": {"dissimilarity_clients": 0}}))
    for _ in range(2):
        exp.step()
    t = time.perf_counter()
    for _ in range(args.rounds):
        exp.step()
    round_s = (time.perf_counter() - t) / args.rounds
    params, buffers = exp.state["params"], exp.state["buffers"]
    clients = [({k: v + 0.01 * torch.randn_like(v) for k, v in params.items()}, buffers)
               for _ in range(10)]
    print(f"one round (10 clients x 20 steps, with evaluation): {round_s:.3f} s")
    for size in map(int, args.probes.split(",")):
        x = exp.data.x_test[torch.from_numpy(probe_indices(len(exp.data.y_test), size, 0))]
        t = time.perf_counter()
        for _ in range(args.rounds):
            mean_client_mmd(exp.alg.model, clients, (exp.alg.model, params, buffers), x)
        s = (time.perf_counter() - t) / args.rounds
        print(f"FFD probe {size:4d}: {s:.3f} s per round ({100 * s / round_s:.0f}% of a round)")


if __name__ == "__main__":
    main()
