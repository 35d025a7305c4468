"""protofl vs HtFLlib on one model-heterogeneous federation: FedProto and FedTGP, 3 seeds.

One federation is written for both: protofl's digits split (10 clients, Dirichlet 0.1), each
client's training and local test rows written as HtFLlib reads them
(``dataset/<name>/{train,test}/<k>.npz`` holding ``data = {"x", "y"}``, the model inputs
protofl trains on). Both train four models of one feature size d = 128 in turn over the
clients (client k: model k mod 4) with the FedTGP protocol's local work (SGD, lr 0.01, batch
10, one epoch), every client every round, and report the pooled accuracy of every client's
model on its own test rows after the last round and the seconds per round (training,
aggregation and each round's evaluation; one torch thread each).

The models are each library's own and differ: HtFLlib's ``CNN`` (one 5x5 conv of 32
channels, max-pool, then fully connected layers of widths H + [d]) with H = [], [256],
[512], [256, 256]; protofl's ``htfe-cnn`` family (3x3 convs: cnn1, cnn2, cnn3, cnn_wide, then
fc d). HtFLlib's FedTGP trains its server prototypes with the local learning rate; protofl's
is set to the same (``algo.server_lr = 0.01``).

HtFLlib is run from a local checkout outside this repository (``--htfllib``, default
``$HTFLLIB`` or /work/htfllib; its ``system/`` folder on the path) in a subprocess. Its
model module imports torchvision at the top, but the models used here need none of it: where
torchvision is not installed, an empty stand-in module is put on that subprocess's path
(and said so). It also needs h5py (``pip install h5py``; ``<checkout>/_deps`` is added to
the path when present). Without a checkout, only protofl's side runs.

    python benchmarks/hetero_vs_htfllib.py [--rounds 20] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HTFLLIB_MODELS = [f"CNN(in_features=1, num_classes=10, height=8, num_cov=1, feature_dim=128, "
                  f"hidden_dims={h})" for h in ([], [256], [512], [256, 256])]
DIM = 128


def config(algorithm: str, seed: int, rounds: int) -> dict:
    return {
        "algorithm": algorithm, "seed": seed, "rounds": rounds, "checkpoint_every": 0,
        "threads": 1, "workers": 1, "trainer": "vectorized",
        "data": {"name": "digits", "num_clients": 10, "partition": "dirichlet", "alpha": 0.1},
        "model": {"family": "htfe-cnn", "feature_dim": DIM},
        "clients": {"per_round": 10, "local_epochs": 1, "batch_size": 10, "optimizer": "sgd",
                    "lr": 0.01, "momentum": 0.0, "weight_decay": 0.0},
        "algo": {"lam": 10.0, "server_epochs": 100, "server_lr": 0.01, "margin_cap": 100.0}
        if algorithm == "fedtgp" else {"lam": 1.0},
        "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 0, "amm": False},
    }


def write_federation(root: Path, name: str = "protofl_digits") -> int:
    """protofl's digits split as HtFLlib's per-client npz files; the number of clients."""
    from protofl.config import config_from_dict
    from protofl.data.registry import load_dataset

    data = load_dataset(config_from_dict(config("fedproto", 0, 1)).data)
    for split in ("train", "test"):
        (root / "dataset" / name / split).mkdir(parents=True, exist_ok=True)
    for k in range(data.num_clients):
        for split, (x, y) in (("train", data.client_train(k)), ("test", data.client_test(k))):
            rows = {"x": data.inputs(x).numpy().astype(np.float32),
                    "y": y.numpy().astype(np.int64)}
            with open(root / "dataset" / name / split / f"{k}.npz", "wb") as f:
                np.savez_compressed(f, data=rows)
    (root / "system").mkdir(exist_ok=True)
    return data.num_clients


def run_protofl(algorithm: str, seed: int, rounds: int) -> tuple[float, float]:
    """(pooled accuracy after the last round, seconds per round)."""
    from protofl.config import config_from_dict
    from protofl.engine.experiment import Experiment

    exp = Experiment(config_from_dict(config(algorithm, seed, rounds)), callbacks=None)
    summary = exp.run()
    return float(summary["accuracy"]), float(summary["seconds"]) / rounds


def htfllib_worker(algorithm: str, seed: int, rounds: int, root: str, checkout: str,
                   clients: int) -> None:
    """Runs inside the subprocess: HtFLlib's server on the written federation; prints JSON."""
    import random
    import types

    import torch

    sys.path[:0] = [str(Path(checkout) / "system"), str(Path(checkout) / "_deps")]
    stub = False
    try:
        import torchvision  # noqa: F401
    except ImportError:  # only `import torchvision` at the top of its models module
        sys.modules["torchvision"] = types.ModuleType("torchvision")
        stub = True
    os.chdir(Path(root) / "system")  # it reads ../dataset/<name>/...
    torch.set_num_threads(1)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if algorithm == "fedtgp":
        from flcore.servers.servertgp import FedTGP as Server
    else:
        from flcore.servers.serverproto import FedProto as Server
    args = argparse.Namespace(
        goal="bench", device="cpu", dataset="protofl_digits", num_classes=10,
        models=HTFLLIB_MODELS, batch_size=10, local_learning_rate=0.01,
        # its loop evaluates, then trains, in rounds 0..R: the evaluation of round R is the
        # one after R rounds of training (its round R's training is timed, never scored)
        learning_rate_decay=False, global_rounds=rounds,
        top_cnt=100, local_epochs=1, algorithm="FedTGP" if algorithm == "fedtgp" else "FedProto",
        join_ratio=1.0, random_join_ratio=False, num_clients=clients, prev=0, times=1,
        eval_gap=1, save_folder_name="temp", auto_break=False, feature_dim=DIM,
        models_folder_name="", few_shot=0, client_drop_rate=0.0, train_slow_rate=0.0,
        send_slow_rate=0.0, time_select=False, time_threthold=10000,
        lamda=10.0 if algorithm == "fedtgp" else 1.0, server_epochs=100,
        margin_threthold=100.0)
    server = Server(args, 0)
    server.train()
    print(json.dumps({"accuracy": float(server.rs_test_acc[-1]),
                      "seconds_per_round": float(np.mean(server.Budget)), "stub": stub}))


def run_htfllib(algorithm: str, seed: int, rounds: int, root: Path, checkout: Path,
                clients: int) -> tuple[float, float, bool]:
    cmd = [sys.executable, __file__, "--worker", algorithm, str(seed), str(rounds), str(root),
           str(checkout), str(clients)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"HtFLlib failed: {out.stderr.strip().splitlines()[-1:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return got["accuracy"], got["seconds_per_round"], got["stub"]


def mean_std(values: list[float]) -> str:
    return f"{np.mean(values):.4f} ± {np.std(values):.4f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--algorithms", default="fedproto,fedtgp")
    p.add_argument("--htfllib", default=os.environ.get("HTFLLIB", "/work/htfllib"))
    a = p.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    checkout = Path(a.htfllib)
    have = (checkout / "system" / "flcore" / "servers" / "serverproto.py").exists()
    if not have:
        print(f"no HtFLlib checkout at {checkout}: protofl's side only")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        clients = write_federation(root)
        for alg in a.algorithms.split(","):
            ours, theirs, stub = [], [], False
            for seed in seeds:
                start = time.perf_counter()
                ours.append(run_protofl(alg, seed, a.rounds))
                if have:
                    acc, spr, stub = run_htfllib(alg, seed, a.rounds, root, checkout, clients)
                    theirs.append((acc, spr))
                print(f"  {alg} seed {seed}: {time.perf_counter() - start:.1f} s", flush=True)
            x = float(np.mean([s for _, s in ours]))
            line = f"[hetero {alg}, digits 10 clients Dir(0.1), {a.rounds} rounds] vs htfllib: "
            if theirs:
                y = float(np.mean([s for _, s in theirs]))
                print(f"{line}protofl {x:.3f} s/round, other {y:.3f} s/round, ratio {y / x:.2f}")
                print(f"  accuracy over seeds {seeds}: protofl {mean_std([c for c, _ in ours])}, "
                      f"htfllib {mean_std([c for c, _ in theirs])}"
                      + (" (torchvision stand-in)" if stub else ""))
            else:
                print(f"{line}protofl {x:.3f} s/round, other n/a")
                print(f"  accuracy over seeds {seeds}: protofl {mean_std([c for c, _ in ours])}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        alg, seed, rounds, root, checkout, clients = sys.argv[2:8]
        htfllib_worker(alg, int(seed), int(rounds), root, checkout, int(clients))
    else:
        main()
