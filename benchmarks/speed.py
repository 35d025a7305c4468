"""Per-round wall time and peak memory of FedAvg workloads trained several ways, and the cost
of the default per-round metrics on the seed's MNIST protocol.

    python benchmarks/speed.py            # full: 3 warm-up + 10 timed rounds per variant
    python benchmarks/speed.py --quick    # 1 warm-up + 3 timed rounds; CNN: 5 local steps;
                                          # mnist: 5 local epochs, 1 warm-up + 2 timed rounds
    python benchmarks/speed.py --workloads mnist --mnist-epochs 20   # the seed's protocol

Workloads ``mlp`` and ``cnn`` compare these variants (same model, clients, local steps, batch
size, SGD learning rate):

- ``vectorized``: protofl's vmap trainer (``engine/vectorized.py``) + FedAvg aggregation;
- ``sequential``: protofl's reference trainer (``engine/train.py``);
- ``loop``: a plain PyTorch loop as research code writes it: deepcopy the global model per
  client, an optimizer per client, a DataLoader over a TensorDataset per client, then a
  weighted average of the state dicts;
- ``flower``: Flower's simulation engine (``flwr.simulation.run_simulation``, Ray backend, one
  CPU per ClientApp actor) with a ServerApp running ``FedAvg`` and a ClientApp doing the same
  local loop as ``loop``. Per-round time is measured on the server side: the strategy's
  ``evaluate_fn`` runs before round 1 and after every round, so the gaps between its calls are
  round times; Ray start-up happens before the first call and the warm-up rounds (actor
  start-up, first imports) are dropped;
- ``floor``: the physical limit for the round's arithmetic: one ordinary model takes, at each
  local step, the batches of all the round's clients at once (clients x batch rows) through
  forward, backward and an SGD step. Not a federated round (one model instead of one per
  client), but the same FLOPs in the largest, most efficient operations.

Lines ``[workload] vs OTHER: protofl X s/round, other Y s/round, ratio Z`` give OTHER's time
over protofl's vectorized trainer's (ratio > 1: protofl is faster; ``vs floor`` is below 1).

Workload ``mnist`` is the seed's MNIST protocol (``configs/mnist.yaml``: fedmargin, 1,000
clients, 10 a round, half stragglers, 20 local epochs, batch 10, LEAF CNN) on generated 28x28
digits written as MNIST's IDX files (``workloads.write_mnist_like``: the real files' sample
counts, so the same power-law client sizes). Two experiments run round by round in turn, one
with the default metrics (``workloads.MNIST_METRICS`` applied on top of the config defaults)
and one with every ``metrics.*`` figure off (no dissimilarity, AMM or training loss; the test
and local accuracy of the evaluation still run), and it prints
``[mnist] metrics overhead: default X s/round, off Y s/round, ratio Z``. Both sample the same
clients and train the same way, so the difference is the metrics.

Every process uses ``--threads`` torch threads (default 1, as Ray gives each one-CPU actor):
on a small, shared CPU, OpenMP threads that outnumber the free cores spin and can make every
variant many times slower. The in-process variants are timed in ONE subprocess, one round
of each in turn (so load changes on a shared machine hit them alike); Flower runs in its own.
Peak memory is measured per variant in a fresh subprocess (1 warm-up + 1 round; Flower: its
timing run): the largest summed RSS of that process and all its descendants (Ray's processes
for Flower), sampled every 50 ms.
Reported figures are medians over the timed rounds.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory import TreeSampler, now  # noqa: E402
from workloads import (  # noqa: E402
    LR,
    METRICS_OFF,
    MNIST_METRICS,
    VARIANTS,
    WORKLOADS,
    clients_of,
    local_train,
    mnist_experiment,
    workload,
    write_mnist_like,
)

QUICK_STEPS = {"cnn": 5}  # --quick: the CNN does 5 local steps instead of 20 (CPU time)
MNIST_EPOCHS, QUICK_MNIST_EPOCHS = 20, 5  # the seed's local epochs; --quick's


# ---- protofl ----
def protofl_round(trainer_name: str, alg, model, state, jobs, data, setup, t: int):
    """One round of protofl's trainer + aggregation: the only place this benchmark calls the
    engine's training API (adapt here when that API changes)."""
    from protofl.engine.train import RoundContext, SequentialTrainer
    from protofl.engine.vectorized import VectorizedTrainer

    trainer = VectorizedTrainer() if trainer_name == "vectorized" else SequentialTrainer()
    results = trainer.train(RoundContext(alg, alg.broadcast(state), jobs, data, {}, setup, t))
    return alg.aggregate(state, [r.upload for r in results], t)[0]


def protofl_rounds(name: str, trainer_name: str) -> Iterator[float]:
    """Round times of protofl: sample all clients, train them, aggregate (no evaluation)."""
    from protofl.algorithms.registry import make_algorithm
    from protofl.engine.schedule import SAMPLE, STRAGGLE, assign_work, np_rng, sample_clients
    from protofl.engine.train import LocalSetup

    w = WORKLOADS[name]
    data, make_model = workload(name)
    torch.manual_seed(0)
    model = make_model()
    alg = make_algorithm("fedavg", {}, model, data.num_classes)
    state = alg.init_state(model)
    setup = LocalSetup(w["batch"], True, "sgd", LR, 0.0, 0.0, seed=0)
    t = 0
    while True:
        t += 1
        start = now()
        active = sample_clients(data.train_sizes, w["clients"], "uniform", np_rng(0, SAMPLE, t))
        jobs = assign_work(active, w["steps"], 0.0, False, np_rng(0, STRAGGLE, t))
        state = protofl_round(trainer_name, alg, model, state, jobs, data, setup, t)
        yield now() - start


def floor_rounds(name: str) -> Iterator[float]:
    """The round's arithmetic on one ordinary model: every local step takes all clients'
    batches at once (the physical limit; see the module docstring)."""
    import torch.nn.functional as F

    w = WORKLOADS[name]
    data, make_model = workload(name)
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(0)
    rows = w["clients"] * w["batch"]
    model.train()
    while True:
        start = now()
        for _ in range(w["steps"]):
            idx = torch.randint(0, len(data.y_train), (rows,), generator=gen)
            opt.zero_grad()
            _, logits = model(data.x_train[idx])
            F.cross_entropy(logits, data.y_train[idx]).backward()
            opt.step()
        yield now() - start


def loop_rounds(name: str) -> Iterator[float]:
    w = WORKLOADS[name]
    _, make_model = workload(name)
    clients = clients_of(name)
    torch.manual_seed(0)
    global_model = make_model()
    while True:
        start = now()
        states, sizes = [], []
        for x, y in clients:
            local = copy.deepcopy(global_model)
            local_train(local, x, y, w["steps"], w["batch"])
            states.append(local.state_dict())
            sizes.append(len(y))
        total = sum(sizes)
        global_model.load_state_dict(
            {k: sum(n * s[k] for n, s in zip(sizes, states)) / total for k in states[0]})
        yield now() - start


# ---- Flower ----
def flower_rounds(name: str, rounds: int) -> list[float]:
    import logging

    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
    from flwr.simulation import run_simulation

    w = WORKLOADS[name]
    stamps: list[float] = []
    replies: list[int] = []
    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        k = int(context.node_config["partition-id"])
        x, y = clients_of(name)[k]
        model = workload(name)[1]()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        local_train(model, x, y, w["steps"], w["batch"])
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                              "metrics": MetricRecord({"num-examples": len(y)})})
        return Message(content=content, reply_to=msg)

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        torch.manual_seed(0)
        model = workload(name)[1]()
        def count_replies(records, key):  # every round must hear from every client
            replies.append(len(records))
            return aggregate_metricrecords(records, key)

        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0,
                          min_train_nodes=w["clients"], min_available_nodes=w["clients"],
                          train_metrics_aggr_fn=count_replies)

        def stamp(server_round: int, arrays: ArrayRecord) -> None:
            stamps.append(now())
            return None

        strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                       num_rounds=rounds, evaluate_fn=stamp)

    logging.getLogger("flwr").setLevel(logging.WARNING)
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=w["clients"],
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": os.cpu_count(),
                                                 "include_dashboard": False}})
    if len(stamps) != rounds + 1 or replies != [w["clients"]] * rounds:
        raise RuntimeError(f"flower: {len(stamps) - 1} rounds ran, replies per round {replies}")
    return [b - a for a, b in zip(stamps, stamps[1:])]


def mnist_rounds(epochs: int, total: int) -> dict[str, list[float]]:
    """Round times (training + metrics) of the MNIST protocol with the default metrics and
    with every metric off, one round of each in turn; wall times, and CPU times (``-cpu``)."""
    import tempfile
    import time

    with tempfile.TemporaryDirectory() as root:
        write_mnist_like(root)
        exps = {"default": mnist_experiment(root, epochs, total, metrics=MNIST_METRICS),
                "off": mnist_experiment(root, epochs, total, metrics=METRICS_OFF)}
        times: dict[str, list[float]] = {k: [] for v in exps for k in (v, v + "-cpu")}
        for _ in range(total):
            for v, exp in exps.items():
                start, cpu = now(), time.process_time()
                exp.step()
                times[v].append(now() - start)
                times[v + "-cpu"].append(time.process_time() - cpu)
    return times


def child(variant: str, name: str, warmup: int, rounds: int, threads: int) -> dict:
    """Round times of one variant, or of several in-process ones (``a+b+c``) run round by
    round in turn, so that a change in the machine's load hits them alike."""
    torch.set_num_threads(threads)
    total = warmup + rounds
    with TreeSampler() as mem:
        if variant == "flower":
            times = {variant: flower_rounds(name, total)}
        elif name == "mnist":
            times = mnist_rounds(WORKLOADS["mnist"]["steps"], total)
        else:
            make = {"loop": loop_rounds, "floor": floor_rounds}
            runs = {v: make[v](name) if v in make else protofl_rounds(name, v)
                    for v in variant.split("+")}
            times = {v: [] for v in runs}
            for _ in range(total):
                for v, run in runs.items():
                    times[v].append(next(run))
    timed = {v: t[warmup:] for v, t in times.items()}
    return {"variant": variant, "workload": name, "times": timed,
            "median": {v: statistics.median(t) for v, t in timed.items()}, "peak_rss": mem.peak}


def run_child(variant: str, name: str, warmup: int, rounds: int, threads: int,
              timeout: float, steps: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, name,
           "--warmup", str(warmup), "--rounds", str(rounds), "--threads", str(threads),
           "--steps", str(steps)]
    here = os.path.dirname(os.path.abspath(__file__))  # Ray's workers import workloads.py
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [here, *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "workload": name, "error": f"timed out after {timeout} s"}
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"variant": variant, "workload": name,
            "error": (out.stderr.strip().splitlines() or ["no output"])[-1][:300]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 warm-up + 3 timed rounds")
    ap.add_argument("--workloads", default="mlp,cnn,mnist")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per process (default 1: see the module docstring)")
    ap.add_argument("--steps", type=int, default=None,
                    help="local steps per client (default: the workload's; --quick: 5 for cnn)")
    ap.add_argument("--mnist-epochs", type=int, default=None,
                    help=f"mnist: local epochs (default {MNIST_EPOCHS}; --quick: "
                         f"{QUICK_MNIST_EPOCHS})")
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "WORKLOAD"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    warmup = a.warmup if a.warmup is not None else (1 if a.quick else 3)
    rounds = a.rounds if a.rounds is not None else (3 if a.quick else 10)
    WORKLOADS["mnist"] = {"title": "seed's MNIST protocol, generated 28x28 digits",
                          "steps": a.mnist_epochs or (QUICK_MNIST_EPOCHS if a.quick
                                                      else MNIST_EPOCHS)}
    if a.child:
        WORKLOADS[a.child[1]]["steps"] = a.steps
        print(json.dumps(child(*a.child, warmup, rounds, a.threads)), flush=True)
        return
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, torch threads {a.threads} per "
          f"process; {warmup} warm-up + {rounds} timed rounds; medians")
    for name in a.workloads.split(","):
        if name == "mnist":
            mnist_report(a, a.warmup if a.warmup is not None else 1,
                         a.rounds if a.rounds is not None else (2 if a.quick else 5))
            continue
        w = WORKLOADS[name]
        w["steps"] = a.steps or (QUICK_STEPS.get(name, w["steps"]) if a.quick else w["steps"])
        print(f"\n== {w['title']}: {w['clients']} active clients x {w['steps']} local steps of "
              f"batch {w['batch']}")
        res = {}
        wanted = a.variants.split(",")
        local = [v for v in wanted if v != "flower"]
        if local:  # timing: in turn, in one process; memory: one process per variant
            both = run_child("+".join(local), name, warmup, rounds, a.threads, timeout=1800,
                             steps=w["steps"])
            for v in local:
                mem = run_child(v, name, 1, 1, a.threads, timeout=900, steps=w["steps"])
                if "error" in both or "error" in mem:
                    res[v] = {"error": both.get("error") or mem.get("error")}
                else:
                    res[v] = {"times": both["times"][v], "median": both["median"][v],
                              "peak_rss": mem["peak_rss"]}
        if "flower" in wanted:
            r = run_child("flower", name, warmup, rounds, a.threads, timeout=900, steps=w["steps"])
            res["flower"] = r if "error" in r else {
                "times": r["times"]["flower"], "median": r["median"]["flower"],
                "peak_rss": r["peak_rss"]}
        for v in wanted:
            r = res[v]
            if "error" in r:
                print(f"{v:>10}: FAILED ({r['error']})", flush=True)
            else:
                print(f"{v:>10}: {r['median']:.4f} s/round (min {min(r['times']):.4f}, "
                      f"max {max(r['times']):.4f}), peak RSS {r['peak_rss'] / 2**20:.0f} MiB",
                      flush=True)
        ours = res.get("vectorized")
        if not ours or "error" in ours:
            continue
        for v, label in (("flower", "flower"), ("loop", "loop"), ("sequential", "sequential"),
                         ("floor", "floor")):
            other = res.get(v)
            if other and "error" not in other:
                ratio = other["median"] / ours["median"]
                print(f"[{name}] vs {label}: protofl {ours['median']:.4f} s/round, other "
                      f"{other['median']:.4f} s/round, ratio {ratio:.2f}")


def mnist_report(a: argparse.Namespace, warmup: int, rounds: int) -> None:
    epochs = WORKLOADS["mnist"]["steps"]
    print(f"\n== {WORKLOADS['mnist']['title']}: fedmargin, 10 of 1,000 clients, {epochs} local "
          f"epochs of batch 10; {warmup} warm-up + {rounds} timed rounds; means")
    print(f"default metrics: the config's, with {MNIST_METRICS}; off: {METRICS_OFF}")
    r = run_child("default+off", "mnist", warmup, rounds, a.threads, timeout=3600, steps=epochs)
    if "error" in r:
        print(f"[mnist] FAILED ({r['error']})", flush=True)
        return
    mean = {v: statistics.fmean(t) for v, t in r["times"].items()}
    for v, t in r["times"].items():
        print(f"{v:>11}: {mean[v]:.3f} s/round (min {min(t):.3f}, max {max(t):.3f})")
    print(f"peak RSS {r['peak_rss'] / 2**20:.0f} MiB (both experiments)")
    print(f"[mnist] metrics overhead (CPU time): default {mean['default-cpu']:.3f} s/round, off "
          f"{mean['off-cpu']:.3f} s/round, ratio {mean['default-cpu'] / mean['off-cpu']:.2f}")
    print(f"[mnist] metrics overhead: default {mean['default']:.3f} s/round, off "
          f"{mean['off']:.3f} s/round, ratio {mean['default'] / mean['off']:.2f}", flush=True)


if __name__ == "__main__":
    main()
