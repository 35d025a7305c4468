"""Per-round cost of each metric against a training round, on the seed's MNIST protocol.

    python benchmarks/metric_cost.py                 # configs/mnist.yaml, 20 local epochs
    python benchmarks/metric_cost.py --epochs 2      # a shorter round (quicker, larger ratios)

The data are generated 28x28 digits written as MNIST's IDX files (``workloads.
write_mnist_like``), so the ``mnist`` loader builds the seed's federation: 1,000 clients, two
digits each, power-law sizes; fedmargin, 10 clients a round (half of them stragglers), batch
10, LEAF CNN. One round is trained (its time is the reference), then each metric is timed on
the aggregate model, ``--repeat`` times (median), with the sizes given on the command line:
pass the old defaults (``--train-loss 20000 --dissimilarity-rows 2000``) to time what the
defaults used to cost. The script only calls functions whose names and arguments are the same
before and after the metrics rework, so running it with ``PYTHONPATH`` at an older source tree
times the old implementation.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import mnist_experiment, write_mnist_like  # noqa: E402


def timed(fn, repeat: int) -> tuple[float, float, object]:
    """Median wall and CPU seconds of ``repeat`` calls, and the last value."""
    wall, cpu, out = [], [], None
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return statistics.median(wall), statistics.median(cpu), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", help="folder of MNIST IDX files (default: generated in a temp dir)")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--train-loss", type=int, default=2000, help="train_loss samples")
    ap.add_argument("--dissimilarity-clients", type=int, default=30)
    ap.add_argument("--dissimilarity-rows", type=int, default=100, help="rows per probe client")
    ap.add_argument("--batch", type=int, default=256, help="evaluation batch")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from protofl.engine.schedule import assign_work, sample_clients
    from protofl.engine.train import RoundContext
    from protofl.metrics import federated as fm
    from protofl.seeding import PROBE, SAMPLE, STRAGGLE, np_rng

    tmp = None
    if not a.data:
        tmp = tempfile.TemporaryDirectory()
        write_mnist_like(tmp.name)
    exp = mnist_experiment(a.data or tmp.name, a.epochs)
    cfg, data, alg = exp.cfg, exp.data, exp.alg
    c = cfg.clients
    active = sample_clients(data.train_sizes, c.per_round, c.sampling,
                            np_rng(cfg.seed, SAMPLE, 1))
    jobs = assign_work(active, c.local_epochs, c.stragglers, c.tolerate_partial,
                       np_rng(cfg.seed, STRAGGLE, 1))
    start, cpu = time.perf_counter(), time.process_time()
    rc = RoundContext(alg, alg.broadcast(exp.state), jobs, data, {}, exp.setup, 1)
    results = exp.trainer.train(rc)
    exp.state, _ = alg.aggregate(exp.state, [r.upload for r in results], 1)
    train, train_cpu = time.perf_counter() - start, time.process_time() - cpu
    rows = sum(len(data.client_train(j.client)[1]) * j.units for j in jobs)
    print(f"torch {torch.__version__}, {a.threads} thread(s); {exp.trainer.name} trainer; "
          f"round 1: {len(jobs)} clients, {rows} training rows, {train:.2f} s "
          f"(CPU {train_cpu:.2f} s); medians of {a.repeat}; % of the round's CPU time")
    st, model, b = exp.state, exp.alg.model, a.batch
    probe = np.sort(np_rng(cfg.seed, PROBE).choice(data.num_clients, a.dissimilarity_clients,
                                                   replace=False))
    cost = {
        "test accuracy (10,000 rows)": lambda: fm.evaluate(
            alg, model, st["params"], st["buffers"], st, data.x_test, data.y_test,
            data.num_classes, b),
        "local accuracy (all clients)": lambda: fm.client_figures(
            fm.client_predictions(alg, model, st, data, {}, b), data.num_classes, False),
        f"train_loss ({a.train_loss} samples)": lambda: fm.train_loss(
            alg, model, st, data, a.train_loss, cfg.seed, b),
        f"dissimilarity ({a.dissimilarity_clients} clients x <= {a.dissimilarity_rows} rows)":
            lambda: fm.gradient_dissimilarity(model, st["params"], st["buffers"], data, probe,
                                              max_per_client=a.dissimilarity_rows),
        "amm": lambda: exp._amm(results),
    }
    for name, fn in cost.items():
        sec, cpu, value = timed(fn, a.repeat)
        shown = f"{value:.4g}" if isinstance(value, float) else "-"
        print(f"{name:>48}: {sec:7.3f} s, CPU {cpu:7.3f} s = {100 * cpu / train_cpu:5.1f}%  "
              f"(value {shown})", flush=True)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
