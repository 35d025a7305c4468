"""Per-round wall time and peak memory of FedAvg workloads trained several ways, and the cost
of the default per-round metrics on the seed's MNIST protocol.

    python benchmarks/speed.py            # full: 3 warm-up + 10 timed rounds per variant
    python benchmarks/speed.py --quick    # 1 warm-up + 3 timed rounds; CNN: 5 local steps;
                                          # mnist: 5 local epochs, 1 warm-up + 5 timed rounds
    python benchmarks/speed.py --workloads mnist --mnist-epochs 20   # the seed's protocol
    python benchmarks/speed.py --quick --device cuda --flower-gpus 0.1   # on a GPU machine

Workloads ``mlp`` and ``cnn`` compare these variants (same model, clients, local steps, batch
size, SGD learning rate):

- ``auto``: protofl as a run trains by default (``trainer: auto``, ``workers: auto``,
  ``threads: null``, ``calibrate: true``: its first, warm-up round measures the trainers'
  costs unless protofl's cache holds them, ``$PROTOFL_CALIBRATE=0`` keeps the constants):
  each round the trainer the measured costs find cheapest; + FedAvg aggregation.
  The ``[workload] vs ...`` lines are this variant's;
- ``vectorized``, ``compiled``, ``sequential``, ``parallel``, ``parallel-sequential``:
  protofl's trainers forced (``engine/vectorized.py``, ``engine/compiled.py`` — windows of
  steps compiled by ``torch.compile``, on CUDA replayed as CUDA graphs —, ``engine/train.py``,
  ``engine/parallel.py``; the parallel trainer's workers choose their in-process trainer per
  round, or are sequential);
- ``loop``: a plain PyTorch loop as research code writes it: deepcopy the global model per
  client, an optimizer per client, a DataLoader over a TensorDataset per client, then a
  weighted average of the state dicts;
- ``flower``: Flower's simulation engine (``flwr.simulation.run_simulation``, Ray backend, one
  CPU per ClientApp actor, or ``--flower-gpus`` of a GPU) with a ServerApp running ``FedAvg``
  and a ClientApp doing the same local loop as ``loop``. Per-round time is measured on the
  server side: the strategy's ``evaluate_fn`` runs before round 1 and after every round, so
  the gaps between its calls are round times; Ray start-up happens before the first call and
  the warm-up rounds (actor start-up, first imports) are dropped;
- ``floor``: the physical limit for the round's arithmetic: one ordinary model takes, at each
  local step, the batches of all the round's clients at once (clients x batch rows) through
  forward, backward and an SGD step. Not a federated round (one model instead of one per
  client), but the same FLOPs in the largest, most efficient operations.

Lines ``[workload] vs OTHER: protofl X s/round, other Y s/round, ratio Z`` give OTHER's time
over protofl's (``auto``; ratio > 1: protofl is faster; ``vs floor`` is below 1).

Cores: Flower runs one actor per core (Ray gives each one CPU and one torch thread), protofl's
``auto`` one worker process per core (``--workers``, default every usable core) with one
thread each, or, where it trains in one process (the MLP), a run's default threads (1 for
models under a million parameters). The single-process variants (``loop``, ``floor``, forced
``vectorized``/``sequential``) get ``--threads`` torch threads, default 1: on a shared CPU,
OpenMP threads that outnumber the free cores spin and made every multi-threaded variant 5-100x
slower (a 2-thread MLP loop round took 120 s instead of 1 s at a load average of 10 on 2
cores); on an idle machine ``--threads 2`` gives the plain loop both cores. The in-process
variants are timed in
ONE subprocess, one round of each in turn, the order rotating each round (so load changes on
a shared machine hit them alike, and no variant always runs after the same other one;
idle worker processes wait on a pipe and take no CPU); Flower runs in its own. Peak memory is
measured per variant in a fresh subprocess (1 warm-up + 1 round; Flower: its timing run): the
largest summed proportional set size (PSS: a page shared by n processes counts 1/n, so forked
workers and Ray's processes are not counted twice) of that process and all its descendants,
sampled every 50 ms. Reported figures are medians over the timed rounds.

Workloads ``mnist-protocol`` (a round of the seed's MNIST protocol as FedAvg: configs/mnist.yaml's
1,000 clients, 10 a round drawn per round, E = 20 local epochs of batch 10, LEAF CNN; the real
MNIST files where the config's data.root holds them, else generated ones) and ``deeplab``
(DeepLab-V3+ on Shapes at 64 px) compare the same variants (no floor for mnist-protocol);
``--headline`` runs configs/mnist.yaml's 100 rounds to the end:
``[mnist-protocol] 100 rounds: N s``. ``--jsonl FILE`` appends each figure as it is measured.

Workload ``mnist`` is the seed's MNIST protocol (``configs/mnist.yaml``: fedmargin, 1,000
clients, 10 a round, half stragglers, 20 local epochs, batch 10, LEAF CNN) on generated 28x28
digits written as MNIST's IDX files (``workloads.write_mnist_like``: the real files' sample
counts, so the same power-law client sizes), run through ``Experiment`` with the config's
defaults (trainer, workers, threads, device, metrics). The hooks of the metrics one can switch
off (AMM, training loss, gradient dissimilarity) are timed inside each round, and it prints
``[mnist] metrics overhead: default X s/round, off Y s/round, ratio Z``: X the mean round
(training, aggregation, evaluation, metrics), Y the same rounds less the metrics' time. (The
test and local accuracy of the evaluation run in both.)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory import TreeSampler, now, tree_cpu  # noqa: E402
from workloads import (  # noqa: E402
    LR,
    MNIST_CONFIG,
    VARIANTS,
    WORKLOADS,
    active_clients,
    clients_of,
    local_steps,
    local_train,
    loss_of,
    mnist_experiment,
    mnist_files_in,
    workload,
    write_mnist_like,
)

# --quick: fewer local steps (epochs for mnist-protocol) than the workload's (CPU time)
QUICK_STEPS = {"cnn": 5, "mnist-protocol": 1, "deeplab": 2}
MNIST_EPOCHS, QUICK_MNIST_EPOCHS = 20, 5  # the seed's local epochs; --quick's


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ---- protofl ----
def protofl_trainer(variant: str, model, workers: int, device: str = "cpu"):
    """protofl's trainer of a variant: ``auto`` is what a run trains with by default (each
    round the trainer the cost model finds cheapest), the others force one. The only place
    this benchmark builds an engine trainer."""
    from protofl.engine import trainers
    from protofl.engine.parallel import ParallelTrainer

    if variant == "parallel-sequential":
        return ParallelTrainer(workers, "sequential")
    return trainers.make(variant, model, device, workers, rounds=1000, calibrate=True)


def protofl_threads(variant: str, model, threads: int) -> int:
    """Torch threads of a protofl variant's process: ``auto`` takes a run's default
    (``threads: null``: 1 for small models, else half the cores), ``parallel`` 1 (its workers
    have one each), the others ``--threads``."""
    from protofl.engine.spec import auto_threads

    if variant == "auto":
        return auto_threads(sum(p.numel() for p in model.parameters()))
    return 1 if variant.startswith("parallel") else threads


def protofl_rounds(name: str, variant: str, workers: int, threads: int, device: str
                   ) -> Iterator[float]:
    """Round times of protofl: sample all clients, train them, aggregate (no evaluation)."""
    import numpy as np

    from protofl import device as devices
    from protofl.algorithms.registry import make_algorithm
    from protofl.engine.schedule import assign_work
    from protofl.engine.train import LocalSetup, RoundContext
    from protofl.seeding import STRAGGLE, np_rng

    w = WORKLOADS[name]
    data, make_model = workload(name)
    torch.manual_seed(0)
    model = make_model().to(device)
    alg = make_algorithm("fedavg", {}, model, data.num_classes)
    server = devices.server_device(device)  # where the engine aggregates
    state = devices.to_device(alg.init_state(model), server)
    setup = LocalSetup(w["batch"], not w.get("epochs"), "sgd", LR, 0.0, 0.0, seed=0,
                       device=device)
    trainer = protofl_trainer(variant, alg.model, workers, device)
    own = protofl_threads(variant, alg.model, threads)
    t = 0
    while True:
        t += 1
        torch.set_num_threads(own)
        start = now()
        active = np.array(active_clients(name, t))
        jobs = assign_work(active, w["steps"], 0.0, False, np_rng(0, STRAGGLE, t))
        results = trainer.train(RoundContext(alg, alg.broadcast(state), jobs, data, {}, setup,
                                             t))
        # uploads meet the server state on its device, as in the engine's round
        state = alg.aggregate(state, [devices.to_device(r.upload, server) for r in results],
                              t)[0]
        sync(device)
        yield now() - start


def floor_rounds(name: str, threads: int, device: str) -> Iterator[float]:
    """The round's arithmetic on one ordinary model: every local step takes all clients'
    batches at once (the physical limit; see the module docstring)."""
    w = WORKLOADS[name]
    data, make_model = workload(name)
    torch.manual_seed(0)
    model = make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(0)
    rows = w["clients"] * w["batch"]
    model.train()
    while True:
        torch.set_num_threads(threads)
        start = now()
        for _ in range(w["steps"]):
            idx = torch.randint(0, len(data.y_train), (rows,), generator=gen)
            opt.zero_grad()
            _, logits = model(data.x_train[idx].to(device))
            loss_of(logits, data.y_train[idx].to(device)).backward()
            opt.step()
        sync(device)
        yield now() - start


def loop_rounds(name: str, threads: int, device: str) -> Iterator[float]:
    w = WORKLOADS[name]
    _, make_model = workload(name)
    clients = clients_of(name)
    torch.manual_seed(0)
    global_model = make_model().to(device)
    t = 0
    while True:
        t += 1
        torch.set_num_threads(threads)
        start = now()
        states, sizes = [], []
        for k in active_clients(name, t):
            x, y = clients[k]
            local = copy.deepcopy(global_model)
            local_train(local, x, y, local_steps(name, len(y)), w["batch"], device)
            states.append(local.state_dict())
            sizes.append(len(y))
        total = sum(sizes)
        global_model.load_state_dict(
            {k: sum(n * s[k] for n, s in zip(sizes, states)) / total for k in states[0]})
        sync(device)
        yield now() - start


# ---- Flower ----
def flower_rounds(name: str, rounds: int, gpus: float = 0.0, device: str = "cpu"
                  ) -> list[float]:
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
        # node i of the w["clients"] nodes trains the round's i-th client (the same ones as
        # protofl and the loop: for a pool, the clients that round draws)
        t = int(msg.content["config"]["server-round"])
        k = active_clients(name, t)[int(context.node_config["partition-id"])]
        x, y = clients_of(name)[k]
        model = workload(name)[1]()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        local_train(model.to(device), x, y, local_steps(name, len(y)), w["batch"], device)
        trained = {k: v.cpu() for k, v in model.state_dict().items()}
        content = RecordDict({"arrays": ArrayRecord(trained),
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
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": gpus},
                                   "init_args": {"num_cpus": os.cpu_count(),
                                                 "include_dashboard": False}})
    if len(stamps) != rounds + 1 or replies != [w["clients"]] * rounds:
        raise RuntimeError(f"flower: {len(stamps) - 1} rounds ran, replies per round {replies}")
    return [b - a for a, b in zip(stamps, stamps[1:])]


def timed_metrics(exp) -> dict[str, float]:
    """Wrap the experiment's metric callbacks (AMM, training loss, dissimilarity) so that
    their hooks add their wall and CPU seconds to the returned dict (the test and local
    accuracy of the evaluation are not metrics one can switch off, and are not counted)."""
    import time

    from protofl.engine.callbacks import Amm, Callback, Dissimilarity, TrainLoss

    spent = {"wall": 0.0, "cpu": 0.0}

    class Timed(Callback):
        def __init__(self, inner):
            self.inner = inner

        def _call(self, hook, *args):
            start, cpu = now(), time.process_time()
            getattr(self.inner, hook)(*args)
            spent["wall"] += now() - start
            spent["cpu"] += time.process_time() - cpu

        def after_aggregate(self, *args):
            self._call("after_aggregate", *args)

        def on_evaluate(self, *args):
            self._call("on_evaluate", *args)

    exp.callbacks = [Timed(cb) if isinstance(cb, (Amm, TrainLoss, Dissimilarity)) else cb
                     for cb in exp.callbacks]
    return spent


def mnist_rounds(epochs: int, total: int, device: str) -> dict[str, list[float]]:
    """Round times of the MNIST protocol with the default metrics (``default``: training,
    aggregation, evaluation and the metrics) and the same rounds less the time the metrics
    took (``off``); wall times, and CPU times of the process and its worker processes
    (``-cpu``)."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        write_mnist_like(root)
        exp = mnist_experiment(root, epochs, 100, device=device)  # the protocol's 100 rounds
        spent = timed_metrics(exp)
        times: dict[str, list[float]] = {k: [] for k in ("default", "off", "default-cpu",
                                                          "off-cpu", "metrics")}
        for _ in range(total):
            before = dict(spent)
            start, cpu = now(), tree_cpu()
            exp.step()
            sync(device)
            wall, used = now() - start, tree_cpu() - cpu
            metric_wall = spent["wall"] - before["wall"]
            times["default"].append(wall)
            times["off"].append(wall - metric_wall)
            times["default-cpu"].append(used)
            times["off-cpu"].append(used - (spent["cpu"] - before["cpu"]))
            times["metrics"].append(metric_wall)
        exp.close()
    return times


def child(variant: str, name: str, warmup: int, rounds: int, a: argparse.Namespace) -> dict:
    """Round times of one variant, or of several in-process ones (``a+b+c``) run round by
    round in turn, so that a change in the machine's load hits them alike."""
    torch.set_num_threads(a.threads)
    total = warmup + rounds
    peaks: dict[str, int] = {}  # per in-process variant, the most allocated on the GPU
    errors: dict[str, str] = {}  # the in-process variants that failed, and why
    with TreeSampler(proportional=True) as mem:
        if variant == "flower":
            times = {variant: flower_rounds(name, total, a.flower_gpus, a.device)}
        elif name == "mnist":
            times = mnist_rounds(WORKLOADS["mnist"]["steps"], total, a.device)
        else:
            runs = {}
            for v in variant.split("+"):
                if v == "loop":
                    runs[v] = loop_rounds(name, a.threads, a.device)
                elif v == "floor":
                    runs[v] = floor_rounds(name, a.threads, a.device)
                else:
                    runs[v] = protofl_rounds(name, v, a.workers, a.threads, a.device)
            times = {v: [] for v in runs}
            peaks = dict.fromkeys(runs, 0)
            for i in range(total):  # the order rotates: no variant always follows another
                names = list(runs)
                if not names:
                    break
                for v in names[i % len(names):] + names[:i % len(names)]:
                    run = runs[v]
                    reset_gpu_peak(a.device)
                    try:
                        times[v].append(next(run))
                    except Exception as e:  # noqa: BLE001 - that variant fails, not the rest
                        errors[v] = failure(e)
                        del runs[v], times[v]
                        continue
                    peaks[v] = max(peaks[v], gpu_peak(a.device) or 0)
    timed = {v: t[warmup:] for v, t in times.items()}
    return {"variant": variant, "workload": name, "times": timed, "errors": errors,
            "median": {v: statistics.median(t) for v, t in timed.items()}, "peak": mem.peak,
            "gpu_peaks": peaks or dict.fromkeys(times, gpu_peak(a.device))}


def failure(e: Exception) -> str:
    """One line: the exception and the innermost frame of protofl or of this benchmark."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if "protofl" in f.filename or "benchmarks" in f.filename]
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first}{where}"


def reset_gpu_peak(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def gpu_peak(device: str) -> int | None:
    """The most bytes torch had allocated on the CUDA device (None elsewhere)."""
    if torch.device(device).type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated())


def headline(device: str) -> dict:
    """The seed's MNIST protocol (configs/mnist.yaml: fedmargin, 100 rounds, 20 local epochs,
    evaluation and the default metrics every round) run to the end: its wall time, with the
    time so far printed every 10 rounds (a run stopped early still tells its pace). On the
    real MNIST files where the config's data.root holds them, else on generated ones."""
    import tempfile

    from protofl.config import load_raw
    from protofl.engine.callbacks import Callback

    class Progress(Callback):
        def on_round_end(self, exp, record) -> None:
            if exp.round % 10 == 0:
                print(f"[mnist-protocol] {exp.round} rounds: {now() - start:.1f} s so far",
                      flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        root = load_raw(str(MNIST_CONFIG))["data"]["root"]
        if not mnist_files_in(root):
            root = tmp
            write_mnist_like(root)
        exp = mnist_experiment(root, 20, 100, device=device)
        exp.callbacks.append(Progress())
        start = now()
        summary = exp.run()
        sync(device)
        seconds = now() - start
    return {"workload": "mnist-protocol", "rounds": 100, "seconds": seconds,
            "accuracy": summary.get("accuracy"), "generated": root == tmp,
            "gpu_peak": gpu_peak(device)}


def run_child(variant: str, name: str, warmup: int, rounds: int, a: argparse.Namespace,
              timeout: float, steps: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, name,
           "--warmup", str(warmup), "--rounds", str(rounds), "--threads", str(a.threads),
           "--workers", str(a.workers), "--steps", str(steps), "--device", a.device,
           "--flower-gpus", str(a.flower_gpus)]
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


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def main() -> None:
    import history  # benchmarks/history.py: record the comparison lines
    history.hook()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 warm-up + 3 timed rounds")
    ap.add_argument("--workloads", default="mlp,cnn,mnist")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the single-process variants (default 1: see the "
                         "module docstring)")
    ap.add_argument("--workers", type=int, default=usable_cores(),
                    help="protofl's worker processes (workers: auto = every usable core)")
    ap.add_argument("--device", default="cpu",
                    help="where protofl, the loop, the floor and Flower's clients train")
    ap.add_argument("--flower-gpus", type=float, default=0.0,
                    help="GPU share of each Flower ClientApp actor (client-resources-num-gpus)")
    ap.add_argument("--steps", type=int, default=None,
                    help="local steps per client (default: the workload's; --quick: 5 for cnn)")
    ap.add_argument("--mnist-epochs", type=int, default=None,
                    help=f"mnist: local epochs (default {MNIST_EPOCHS}; --quick: "
                         f"{QUICK_MNIST_EPOCHS})")
    ap.add_argument("--json", help="also write every result to this JSON file (at the end)")
    ap.add_argument("--jsonl", help="append each result to this file as it is measured")
    ap.add_argument("--headline", action="store_true",
                    help="also run the seed's MNIST protocol's 100 rounds to the end: "
                         "[mnist-protocol] 100 rounds: N s (hours on a CPU)")
    ap.add_argument("--no-memory", action="store_true",
                    help="skip the per-variant peak-memory runs (PSS); GPU peaks are still "
                         "taken per variant in the timing run")
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "WORKLOAD"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    warmup = a.warmup if a.warmup is not None else (1 if a.quick else 3)
    rounds = a.rounds if a.rounds is not None else (3 if a.quick else 10)
    WORKLOADS["mnist"] = {"title": "seed's MNIST protocol, generated 28x28 digits",
                          "steps": a.mnist_epochs or (QUICK_MNIST_EPOCHS if a.quick
                                                      else MNIST_EPOCHS)}
    if a.child:
        WORKLOADS[a.child[1]]["steps"] = a.steps
        print(json.dumps(child(*a.child, warmup, rounds, a)), flush=True)
        return
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs ({usable_cores()} usable), device "
          f"{a.device}; single-process variants {a.threads} torch threads, protofl {a.workers} "
          f"workers; {warmup} warm-up + {rounds} timed rounds; medians; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    report: dict = {"args": vars(a), "results": {}}
    for name in filter(None, a.workloads.split(",")):
        if name == "mnist":
            report["results"]["mnist"] = mnist_report(
                a, a.warmup if a.warmup is not None else 1,
                a.rounds if a.rounds is not None else (5 if a.quick else 10))
            continue
        report["results"][name] = workload_report(a, name, warmup, rounds)
    if a.headline:
        report["results"]["headline"] = headline_report(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


def emit(a: argparse.Namespace, record: dict) -> None:
    """Append one result to ``--jsonl`` as soon as it is measured (a run killed later keeps
    it)."""
    if a.jsonl:
        with open(a.jsonl, "a") as f:
            f.write(json.dumps(record) + "\n")


def show(name: str, v: str, r: dict) -> None:
    if "error" in r:
        print(f"{v:>10}: FAILED ({r['error']})", flush=True)
        return
    gpu = f", peak GPU memory {r['gpu_peak'] / 2**20:.0f} MiB" if r.get("gpu_peak") else ""
    pss = f", peak PSS {r['peak'] / 2**20:.0f} MiB" if r.get("peak") else ""
    print(f"{v:>10}: {r['median']:.4f} s/round (min {min(r['times']):.4f}, "
          f"max {max(r['times']):.4f}){pss}{gpu}", flush=True)


def compare(a: argparse.Namespace, name: str, res: dict, others: tuple[str, ...]) -> None:
    """The ``[workload] vs OTHER`` lines of ``others`` measured so far."""
    ours = res.get("auto")
    if not ours or "error" in ours:
        return
    for v in others:
        other = res.get(v)
        if other and "error" not in other:
            ratio = other["median"] / ours["median"]
            print(f"[{name}] vs {v}: protofl {ours['median']:.4f} s/round, other "
                  f"{other['median']:.4f} s/round, ratio {ratio:.2f}", flush=True)
            emit(a, {"workload": name, "vs": v, "protofl": ours["median"],
                     "other": other["median"], "ratio": ratio})


def workload_report(a: argparse.Namespace, name: str, warmup: int, rounds: int) -> dict:
    w = WORKLOADS[name]
    w["steps"] = a.steps or (QUICK_STEPS.get(name, w["steps"]) if a.quick else w["steps"])
    unit = "local epochs" if w.get("epochs") else "local steps"
    pool = f" of {w['pool']:,}" if "pool" in w else ""
    print(f"\n== {w['title']}: {w['clients']}{pool} active clients x {w['steps']} {unit} of "
          f"batch {w['batch']}", flush=True)
    res = {}
    wanted = [v for v in a.variants.split(",") if not (v == "floor" and w.get("epochs"))]
    local = [v for v in wanted if v != "flower"]
    if local:  # timing: in turn, in one process; memory: one process per variant
        both = run_child("+".join(local), name, warmup, rounds, a, timeout=1800,
                         steps=w["steps"])
        for v in local:
            mem = {"peak": None} if a.no_memory or "error" in both or v in both[
                "errors"] else run_child(
                v, name, 1, 1, a, timeout=900, steps=w["steps"])
            failed = both.get("error") or both["errors"].get(v) or mem.get("error")
            if failed:
                res[v] = {"error": failed}
            else:
                res[v] = {"times": both["times"][v], "median": both["median"][v],
                          "peak": mem["peak"], "gpu_peak": both["gpu_peaks"][v]}
            show(name, v, res[v])
            emit(a, {"workload": name, "variant": v, **res[v]})
        compare(a, name, res, ("loop", "sequential", "vectorized", "parallel",
                               "parallel-sequential", "floor"))
    if "flower" in wanted:
        r = run_child("flower", name, warmup, rounds, a, timeout=900, steps=w["steps"])
        res["flower"] = r if "error" in r else {
            "times": r["times"]["flower"], "median": r["median"]["flower"], "peak": r["peak"],
            "gpu_peak": None}  # in Ray's actor processes: not seen from here
        show(name, "flower", res["flower"])
        emit(a, {"workload": name, "variant": "flower", **res["flower"]})
        compare(a, name, res, ("flower",))
    return res


def headline_report(a: argparse.Namespace) -> dict:
    """``[mnist-protocol] 100 rounds: N s``: the seed's protocol run to the end, in this
    process (so its progress lines reach the output as they come)."""
    print("\n== the seed's MNIST protocol, 100 rounds (configs/mnist.yaml: fedmargin, 10 of "
          "1,000 clients, 20 local epochs, evaluation and default metrics every round)",
          flush=True)
    torch.set_num_threads(a.threads)
    r = headline(a.device)
    gpu = f", peak GPU memory {r['gpu_peak'] / 2**20:.0f} MiB" if r.get("gpu_peak") else ""
    data = "generated MNIST-shaped digits" if r["generated"] else "the real MNIST files"
    print(f"[mnist-protocol] 100 rounds: {r['seconds']:.1f} s (device {a.device}, {data}; "
          f"final accuracy {r['accuracy']:.4f}{gpu})", flush=True)
    emit(a, r)
    return r


def mnist_report(a: argparse.Namespace, warmup: int, rounds: int) -> dict:
    from protofl.config import MetricsConfig

    epochs = WORKLOADS["mnist"]["steps"]
    print(f"\n== {WORKLOADS['mnist']['title']}: fedmargin, 10 of 1,000 clients, {epochs} local "
          f"epochs of batch 10; {warmup} warm-up + {rounds} timed rounds of 100; means (the "
          f"costly metrics run every metrics.every = {MetricsConfig().every} rounds: time whole "
          f"periods)", flush=True)
    print("default: the config's default metrics; off: the same rounds without the time of the "
          "metrics one can switch off (AMM, training loss, dissimilarity)")
    r = run_child("mnist", "mnist", warmup, rounds, a, timeout=3600, steps=epochs)
    if "error" in r:
        print(f"[mnist] FAILED ({r['error']})", flush=True)
        return r
    mean = {v: statistics.fmean(t) for v, t in r["times"].items()}
    for v, t in r["times"].items():
        print(f"{v:>11}: {mean[v]:.3f} s/round (min {min(t):.3f}, max {max(t):.3f})")
    print(f"peak PSS {r['peak'] / 2**20:.0f} MiB (the experiment and its workers)")
    print(f"[mnist] metrics overhead (CPU time, workers included): default "
          f"{mean['default-cpu']:.3f} s/round, off {mean['off-cpu']:.3f} s/round, ratio "
          f"{mean['default-cpu'] / mean['off-cpu']:.2f}")
    print(f"[mnist] metrics overhead: default {mean['default']:.3f} s/round, off "
          f"{mean['off']:.3f} s/round, ratio {mean['default'] / mean['off']:.2f}", flush=True)
    return {**r, "mean": mean}


if __name__ == "__main__":
    main()
