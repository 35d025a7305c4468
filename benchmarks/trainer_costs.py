"""Measure the constants of the trainers' cost model (``src/protofl/engine/costs.py``).

    python benchmarks/trainer_costs.py            # the Synthetic MLP and the LEAF CNN
    python benchmarks/trainer_costs.py --steps 100 --sizes 1 2 4 8

Each figure is the CPU time of one process on one torch thread (``time.process_time``, so
a loaded machine disturbs it less than wall time), per local step at batch 10: the plain step
(the sequential trainer, one client), a vmap step of ``n`` clients (the vectorized trainer with
no plain-step tail) and a compiled step of ``n`` clients (the compiled trainer, after its
compile), each the median of ``--repeats``; and each compile's wall time (the compiled
trainer's first round less a compiled round: one stack size). Then it fits, by least
squares, the model the trainers' choice reads: ``plain = a + arithmetic``,
``vmap(n) = v + n (vc + arithmetic)``, ``compiled(n) = c + n (cc + arithmetic)``,
``arithmetic = 3 x forward FLOPs x batch / rate``, and prints the fitted constants beside the
ones in ``costs.CPU`` (``compile``: the longest compile measured). Last, the plain step on
``--threads`` torch threads (wall time: the threads share it), and the fit of
``wide = a + (threads - 1) sync + arithmetic / (1 + (threads - 1) gain)`` over the models
(``thread_sync``, ``thread_gain``; two models at least).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from protofl.algorithms.registry import make_algorithm
from protofl.data.federated import from_client_lists
from protofl.engine import costs
from protofl.engine.compiled import CompiledTrainer
from protofl.engine.federation import info
from protofl.engine.schedule import Job
from protofl.engine.train import LocalSetup, RoundContext, SequentialTrainer
from protofl.engine.vectorized import VectorizedTrainer
from protofl.models.nets import Mlp, leaf_cnn

BATCH = 10


def workload(name: str, clients: int, steps: int):
    g = torch.Generator().manual_seed(0)
    shape, model = {"mlp": ((60,), lambda: Mlp(60, 10, hidden=(128, 256))),
                    "cnn": ((1, 28, 28), lambda: leaf_cnn((1, 28, 28), 10))}[name]
    n = steps * BATCH
    xs = [torch.randn(n, *shape, generator=g) for _ in range(clients)]
    ys = [torch.randint(0, 10, (n,), generator=g) for _ in range(clients)]
    data = from_client_lists(name, 10, xs, ys, local_test_fraction=0.0)
    torch.manual_seed(0)
    alg = make_algorithm("fedavg", {}, model(), 10, info(data))
    return alg, data


def per_step(trainer, alg, data, n: int, steps: int, repeats: int,
             clock=time.process_time) -> tuple[float, float]:
    """Median seconds (``clock``: CPU time) per step of ``n`` clients training ``steps`` steps
    together, and the wall seconds the first round took beyond a later one's (the compiled
    trainer: its compile)."""
    setup = LocalSetup(batch_size=BATCH, by_steps=True, lr=0.01)
    glob = alg.broadcast(alg.init_state(alg.model))
    rc = RoundContext(alg, glob, [Job(k, steps) for k in range(n)], data, {}, setup, 1)
    first = time.perf_counter()
    trainer.train(rc)  # warm-up (and the compile)
    first = time.perf_counter() - first
    times, walls = [], []
    for _ in range(repeats):
        t, w = clock(), time.perf_counter()
        trainer.train(rc)
        times.append(clock() - t)
        walls.append(time.perf_counter() - w)
    return statistics.median(times) / steps, first - statistics.median(walls)


def fit(rows: list[tuple[float, float, float]]) -> np.ndarray:
    """Least squares of ``t = x0 + n x1 + n F x2`` over rows ``(n, F, t)``."""
    a = np.array([[1.0, n, n * f] for n, f, _ in rows])
    return np.linalg.lstsq(a, np.array([t for *_, t in rows]), rcond=None)[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--models", nargs="+", default=["mlp", "cnn"])
    p.add_argument("--threads", type=int, default=2, help="threads of the wide plain step")
    args = p.parse_args()
    torch.set_num_threads(1)
    plain, vmap, comp, compiles, wide = [], [], [], [], []
    for name in args.models:
        alg, data = workload(name, max(args.sizes), args.steps)
        flops = 3 * costs.forward_flops(alg.model, tuple(data.x_train.shape[1:])) * BATCH
        t, _ = per_step(SequentialTrainer(), alg, data, 1, args.steps, args.repeats)
        plain.append((1, flops, t))
        print(f"[{name}] plain step: {t * 1e6:.0f} us ({flops / 1e6:.2f} MFLOP)", flush=True)
        torch.set_num_threads(args.threads)
        tw, _ = per_step(SequentialTrainer(), alg, data, 1, args.steps, args.repeats,
                         time.perf_counter)
        torch.set_num_threads(1)
        wide.append((1, flops, tw))
        print(f"[{name}] plain step on {args.threads} threads: {tw * 1e6:.0f} us", flush=True)
        for n in args.sizes:
            tv, _ = per_step(VectorizedTrainer(solo_max=0), alg, data, n, args.steps,
                             args.repeats)
            tc, compile_s = per_step(CompiledTrainer(), alg, data, n, args.steps, args.repeats)
            vmap.append((n, flops, tv))
            comp.append((n, flops, tc))
            compiles.append(compile_s)
            print(f"[{name}] {n:2d} clients: vmap step {tv * 1e6:.0f} us, compiled step "
                  f"{tc * 1e6:.0f} us, compile {compile_s:.1f} s", flush=True)
    # the FLOP rate from the plain steps (two models: overhead and rate), then the rest
    (a, rate_inv) = np.linalg.lstsq(np.array([[1.0, f] for _, f, _ in plain]),
                                    np.array([t for *_, t in plain]), rcond=None)[0]
    v, vc, _ = fit(vmap)
    c, cc, _ = fit(comp)
    fitted = {"plain": a, "vmap": v, "vmap_client": vc, "compiled": c, "compiled_client": cc,
              "rate": 1 / rate_inv if rate_inv > 0 else float("nan"), "compile": max(compiles)}
    if len(wide) > 1 and args.threads > 1:  # wide - a = (threads - 1) sync + F / rate q
        x = (args.threads - 1, rate_inv)
        sync, q = np.linalg.lstsq(np.array([[x[0], f * x[1]] for _, f, _ in wide]),
                                  np.array([t - a for *_, t in wide]), rcond=None)[0]
        fitted |= {"thread_sync": sync, "thread_gain": (1 / q - 1) / x[0]}
    for k, val in fitted.items():
        print(f"{k:16s} fitted {val:.3g}  in costs.CPU {costs.CPU[k]:.3g}")


if __name__ == "__main__":
    main()
