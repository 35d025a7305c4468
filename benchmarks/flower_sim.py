"""Per-round wall time of protofl on Flower's simulation engine against the in-process engine,
on the main suite's digits setting (fedavg, 30 clients of non-IID digits, 10 per round, 20
local steps, batch 10; per-round evaluation on the global test set).

    python benchmarks/flower_sim.py              # 1 warm-up + 3 timed rounds each
    python benchmarks/flower_sim.py --rounds 6   # 1 warm-up + 5 timed rounds

``flower``: protofl's ServerApp loop (``run_on_grid``) and ClientApp (``client_app.app``) on
``run_simulation`` (Ray, one CPU per ClientApp actor, ``--cores`` actors); the first actor
to train builds the dataset and writes it to protofl's cache, and every actor maps that one
copy (``data.cache.mapped``) and keeps its federation for the run (``flower/setup.py``). ``in
process``: ``Experiment(cfg).run()`` with the default trainer. Both run the same rounds
(same clients, same local work); round 1 (Ray actors starting, first builds) is the warm-up
and is reported apart. Prints ``[flower-sim] vs in-process: protofl X s/round, other Y
s/round, ratio Z`` (protofl = in process, other = on Flower; ratio > 1: in process is
faster).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time

import torch

from protofl.config import Config, config_from_dict
from protofl.engine.callbacks import Callback, metric_callbacks
from protofl.engine.experiment import Experiment
from protofl.suites import DIGITS_NONIID


class Clock(Callback):
    """perf_counter at the run's start and at the end of every round."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def on_run_start(self, exp) -> None:
        self.marks = [time.perf_counter()]

    def on_round_end(self, exp, record) -> None:
        self.marks.append(time.perf_counter())

    def rounds(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def digits(rounds: int) -> Config:
    raw = {**DIGITS_NONIID, "algorithm": "fedavg", "rounds": rounds, "checkpoint_every": 0,
           "metrics": {"dissimilarity_clients": 0}}
    return config_from_dict(raw)


def in_process(cfg: Config) -> list[float]:
    clock = Clock()
    Experiment(cfg, callbacks=[*metric_callbacks(), clock]).run()
    return clock.rounds()


def on_flower(cfg: Config, cores: int) -> list[float]:
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from protofl.flower import client_app
    from protofl.flower.node import AUDIT_ENV
    from protofl.flower.server_app import run_on_grid

    clock = Clock()
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        run_on_grid(cfg, grid, None, round_timeout=600, node_wait=300, callbacks=[clock])

    logging.getLogger("flwr").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as audit:
        os.environ[AUDIT_ENV] = audit  # the virtual nodes' audit logs, thrown away
        try:
            run_simulation(server, client_app.app, num_supernodes=cfg.data.num_clients,
                           backend_config={"client_resources": {"num_cpus": 1},
                                           "init_args": {"num_cpus": cores}})
        finally:
            os.environ.pop(AUDIT_ENV, None)
    return clock.rounds()


def main() -> None:
    import history  # benchmarks/history.py: record the comparison lines
    history.hook()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="rounds per variant (>= 2)")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                    help="Ray CPUs (one ClientApp actor each)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = digits(max(args.rounds, 2))
    mine, theirs = in_process(cfg), on_flower(cfg, args.cores)
    a, b = sum(mine[1:]) / len(mine[1:]), sum(theirs[1:]) / len(theirs[1:])
    print(f"round 1 (warm-up): in process {mine[0]:.2f} s, on Flower {theirs[0]:.2f} s")
    print(f"[flower-sim] vs in-process: protofl {a:.3f} s/round, other {b:.3f} s/round, "
          f"ratio {b / a:.2f}")


if __name__ == "__main__":
    main()
