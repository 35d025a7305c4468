"""protofl vs HtFLlib, matched: FedProto and FedTGP on one model-heterogeneous federation.

Everything that can be the same is the same on both sides, per seed s:

* data: 3,000 of protofl's generated textures (``generate_tiny_images``, the cifar_tiny
  generator) averaged 2x2 to 3x16x16, standardised by protofl, split by protofl into 20
  clients (Dirichlet 0.1, ``data.seed = s``), 25% of each client kept as its local test set;
  the very arrays protofl trains on are written as HtFLlib's
  ``dataset/<name>/{train,test}/<k>.npz`` (``data = {"x", "y"}``). No augmentation.
* models: ``per_client: [cnn1, cnn2, cnn3, cnn_wide]`` (client k: model k mod 4, d = 128),
  rebuilt layer for layer for HtFLlib (``ProtoflCNN`` below: conv blocks, ``proj`` = fc d +
  ReLU, ``fc`` the head, which HtFLlib's ``BaseHeadSplit`` takes as the head, replacing it
  by ``AdaptiveAvgPool1d(d)``, the identity at size d), and protofl's initial weights of
  seed s copied into every HtFLlib client (FedTGP: protofl's prototype generator copied into
  HtFLlib's ``Trainable_Global_Prototypes``).
* training: SGD lr 0.01, no momentum, batch 10, 1 local epoch, all 20 clients every round,
  lambda 10 (both methods), FedTGP 100 server epochs at server lr 0.01 (HtFLlib uses the
  local lr), margin cap 100, ``rounds`` rounds, HtFLlib's early stopping off.
* score: pooled accuracy over the clients' local test sets after the last round, each
  client with its own model and the nearest global prototype.
* seeds: HtFLlib's ``Client.__init__`` (and its FedProto/FedTGP clients) call
  ``torch.manual_seed(0)``, so a plain HtFLlib run never changes with its seed. The worker
  makes ``torch.manual_seed`` a no-op while the server builds its clients (from the
  harness, at runtime; HtFLlib's files are not edited), then seeds torch, numpy and random
  with s: its client order and server batches vary with s; its initial weights are
  protofl's.

Time per round: protofl's run seconds / rounds (training, aggregation and each round's
evaluation); HtFLlib's mean ``Budget`` over its rounds after round 0 (its own printout:
evaluation, training, aggregation), one torch thread each. Speed lines read
``[workload] vs htfllib: protofl X s/round, other Y s/round, ratio Z`` with
ratio = other / protofl (> 1: protofl faster).

Accuracy: per method, the mean and std over seeds of each side, and the paired difference
protofl - HtFLlib per seed with its mean and 95% t-interval.

HtFLlib runs from a checkout outside this repository (``--htfllib``, default ``$HTFLLIB`` or
/tmp/htfllib; its ``system/`` folder on the path) in a subprocess, e.g. from a clone::

    git clone https://github.com/TsingZ0/HtFLlib /tmp/htfllib
    git -C /tmp/htfllib checkout e959261

(only ``system/flcore`` and ``system/utils`` are needed). Its models module imports
torchvision and its server h5py at the top; the models used here need neither: where they
are missing, empty stand-in modules are put on that subprocess's path (and said so), and
its ``save_results`` (the h5 file) is skipped. Without a checkout, only protofl's side runs.

    python benchmarks/hetero_vs_htfllib.py [--rounds 20] [--seeds 0,1,2,3,4]
        [--algorithms fedproto,fedtgp] [--set fedproto.proto_pass=during ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

DIM = 128
CLIENTS = 20
IMAGES = 3000
MODELS = ("cnn1", "cnn2", "cnn3", "cnn_wide")
NAME = "protofl_textures"


def config(algorithm: str, seed: int, rounds: int, overrides: dict | None = None) -> dict:
    # fedtgp's defaults are the setting (lambda 10, 100 server epochs at lr 0.01, server
    # batch 10, margin cap 100); fedproto's lambda is set to fedtgp's (its default is 1)
    algo: dict = {} if algorithm == "fedtgp" else {"lam": 10.0}
    algo.update((overrides or {}).get(algorithm, {}))
    return {
        "algorithm": algorithm, "seed": seed, "rounds": rounds, "checkpoint_every": 0,
        "threads": 1, "workers": 1, "trainer": "sequential",
        "data": {"name": "cifar_tiny", "seed": seed, "num_clients": CLIENTS,
                 "partition": "dirichlet", "alpha": 0.1, "local_test_fraction": 0.25,
                 "augment": "none"},
        "model": {"per_client": list(MODELS), "feature_dim": DIM},
        "clients": {"per_round": CLIENTS, "local_epochs": 1, "batch_size": 10,
                    "optimizer": "sgd", "lr": 0.01, "momentum": 0.0, "weight_decay": 0.0},
        "algo": algo,
        "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 0, "amm": False},
    }


def textures(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` of protofl's cifar_tiny textures, 2x2-averaged to 16 x 16 (uint8)."""
    from protofl.data.cifar import generate_tiny_images

    x, y = generate_tiny_images(n, seed)
    x = x.reshape(n, 3, 16, 2, 16, 2).astype(np.float64).mean(axis=(3, 5))
    return np.rint(x).astype(np.uint8), y


def federation(cfg_dict: dict):
    """protofl's FederatedData of the matched setting (the partition from data.seed)."""
    from protofl.config import config_from_dict
    from protofl.data.cifar import TINY_CLASSES, TINY_TEST_SEED, TINY_TRAIN_SEED, image_federation

    cfg = config_from_dict(cfg_dict)
    x, y = textures(IMAGES, TINY_TRAIN_SEED)
    xt, yt = textures(200, TINY_TEST_SEED)
    return image_federation("textures16", x, y, xt, yt, list(TINY_CLASSES), cfg.data, CLIENTS)


def write_federation(data, root: Path) -> None:
    """The clients' training and local test rows (the model inputs protofl trains on) as
    HtFLlib's per-client npz files."""
    for split in ("train", "test"):
        (root / "dataset" / NAME / split).mkdir(parents=True, exist_ok=True)
    for k in range(data.num_clients):
        for split, (x, y) in (("train", data.client_train(k)), ("test", data.client_test(k))):
            rows = {"x": data.inputs(x).numpy().astype(np.float32),
                    "y": y.numpy().astype(np.int64)}
            with open(root / "dataset" / NAME / split / f"{k}.npz", "wb") as f:
                np.savez_compressed(f, data=rows)
    (root / "system").mkdir(exist_ok=True)


def run_protofl(algorithm: str, seed: int, rounds: int, root: Path, overrides: dict,
                train: bool = True) -> tuple[float, float]:
    """Runs protofl; writes the federation and the initial weights for HtFLlib under
    ``root``; returns (pooled accuracy after the last round, seconds per round), or with
    ``train`` off only writes them (nan, nan)."""
    from protofl.config import config_from_dict
    from protofl.engine.experiment import Experiment

    cfg = config(algorithm, seed, rounds, overrides)
    data = federation(cfg)
    write_federation(data, root)
    exp = Experiment(config_from_dict(cfg), callbacks=None, data=data)
    init = {g: {**v["params"], **v["buffers"]} for g, v in exp.state["init"].items()}
    saved = {"init": {g: {k: t.detach().clone() for k, t in v.items()} for g, v in init.items()}}
    if algorithm == "fedtgp":
        saved["generator"] = {k: t.detach().clone() for k, t in exp.state["generator"].items()}
    torch.save(saved, root / "init.pt")
    if not train:
        return math.nan, math.nan
    summary = exp.run()
    return float(summary["accuracy"]), float(summary["seconds"]) / rounds


class ProtoflCNN(nn.Module):
    """HtFLlib's side of protofl's CNN members (``models/families.py``), layer for layer:
    3x3 conv-ReLU-maxpool blocks, ``proj`` = fc d + ReLU (protofl's ``fc``), ``fc`` the
    head (protofl's ``classifier``), which HtFLlib's BaseHeadSplit takes as the head."""

    def __init__(self, name: str, in_shape=(3, 16, 16), num_classes: int = 10,
                 dim: int = DIM):
        super().__init__()
        from protofl.models.families import CNNS

        blocks, c = [], in_shape[0]
        for ch in CNNS[name]:
            blocks += [nn.Conv2d(c, ch, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
            c = ch
        self.features = nn.Sequential(*blocks, nn.Flatten())
        with torch.no_grad():
            flat = self.features(torch.zeros(1, *in_shape)).shape[1]
        self.proj = nn.Sequential(nn.Linear(flat, dim), nn.ReLU())
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, x):
        return self.fc(self.proj(self.features(x)))


def load_protofl_weights(model, weights: dict) -> None:
    """protofl's ``features.* / fc.* / classifier.*`` into HtFLlib's BaseHeadSplit
    (``base.features.* / base.proj.* / head.*``)."""
    own = model.state_dict()
    mapped = {}
    for k, v in weights.items():
        if k.startswith("features."):
            mapped["base." + k] = v
        elif k.startswith("fc."):
            mapped["base.proj." + k[3:]] = v
        elif k.startswith("classifier."):
            mapped["head." + k[len("classifier."):]] = v
    if set(mapped) != set(own) or any(mapped[k].shape != own[k].shape for k in own):
        raise RuntimeError(f"weights do not match: {sorted(mapped)} vs {sorted(own)}")
    with torch.no_grad():
        model.load_state_dict(mapped)


def htfllib_worker(algorithm: str, seed: int, rounds: int, root: str, checkout: str) -> None:
    """Runs inside the subprocess: HtFLlib's server on the written federation; prints JSON."""
    import random
    import types

    sys.path[:0] = [str(Path(checkout) / "system")]
    stubs = []
    for mod in ("torchvision", "h5py"):  # imported at the top of modules, unused here
        try:
            __import__(mod)
        except ImportError:
            sys.modules[mod] = types.ModuleType(mod)
            stubs.append(mod)
    os.chdir(Path(root) / "system")  # it reads ../dataset/<name>/...
    torch.set_num_threads(1)
    import flcore.trainmodel.models as models

    models.ProtoflCNN = ProtoflCNN
    if algorithm == "fedtgp":
        from flcore.servers.servertgp import FedTGP as Server
    else:
        from flcore.servers.serverproto import FedProto as Server
    from flcore.clients.clientbase import load_item, save_item

    args = argparse.Namespace(
        goal="bench", device="cpu", dataset=NAME, num_classes=10,
        models=[f"ProtoflCNN({m!r})" for m in MODELS], batch_size=10,
        local_learning_rate=0.01,
        # its loop evaluates, then trains, in rounds 0..R: the evaluation of round R is the
        # one after R rounds of training (its round R's training is timed, never scored)
        learning_rate_decay=False, global_rounds=rounds, top_cnt=100, local_epochs=1,
        algorithm="FedTGP" if algorithm == "fedtgp" else "FedProto", join_ratio=1.0,
        random_join_ratio=False, num_clients=CLIENTS, prev=0, times=1, eval_gap=1,
        save_folder_name="temp", auto_break=False, feature_dim=DIM, models_folder_name="",
        few_shot=0, client_drop_rate=0.0, train_slow_rate=0.0, send_slow_rate=0.0,
        time_select=False, time_threthold=10000, lamda=10.0, server_epochs=100,
        margin_threthold=100.0)
    # HtFLlib's clients call torch.manual_seed(0) in __init__: a no-op while they are built
    real_seed = torch.manual_seed
    torch.manual_seed = lambda s: torch.default_generator
    try:
        random.seed(seed)
        np.random.seed(seed)
        real_seed(seed)
        server = Server(args, 0)
    finally:
        torch.manual_seed = real_seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    init = torch.load(Path(root) / "init.pt")
    for c in server.clients:
        model = load_item(c.role, "model", c.save_folder_name)
        load_protofl_weights(model, init["init"][f"m{c.id % len(MODELS)}"])
        save_item(model, c.role, "model", c.save_folder_name)
    if algorithm == "fedtgp":
        tgp = load_item(server.role, "TGP", server.save_folder_name)
        g = init["generator"]
        with torch.no_grad():
            tgp.embedings.weight.copy_(g["emb"])
            tgp.middle[0][0].weight.copy_(g["w1"])
            tgp.middle[0][0].bias.copy_(g["b1"])
            tgp.fc.weight.copy_(g["w2"])
            tgp.fc.bias.copy_(g["b2"])
        save_item(tgp, server.role, "TGP", server.save_folder_name)
    server.save_results = lambda: None  # its h5 file of the curve
    out, sys.stdout = sys.stdout, open(os.devnull, "w")  # noqa: SIM115 (its printouts)
    try:
        server.train()
    finally:
        sys.stdout.close()
        sys.stdout = out
    print(json.dumps({"accuracy": float(server.rs_test_acc[-1]),
                      "curve": [float(a) for a in server.rs_test_acc],
                      "seconds_per_round": float(np.mean(server.Budget[1:])), "stubs": stubs}))


def run_htfllib(algorithm: str, seed: int, rounds: int, root: Path, checkout: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", algorithm, str(seed), str(rounds), str(root),
           str(checkout)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"HtFLlib failed: {out.stderr.strip().splitlines()[-3:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131}


def paired(diffs: list[float]) -> tuple[float, float, float]:
    """Mean of the paired differences and its 95% t-interval (lo, hi)."""
    n = len(diffs)
    m = float(np.mean(diffs))
    if n < 2:
        return m, math.nan, math.nan
    half = T975.get(n - 1, 1.96) * float(np.std(diffs, ddof=1)) / math.sqrt(n)
    return m, m - half, m + half


def sd(values: list[float]) -> float:
    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def parse_overrides(items: list[str]) -> dict:
    """``alg.key=value`` pairs (value as JSON, else a string) -> {alg: {key: value}}."""
    out: dict = {}
    for item in items:
        lhs, value = item.split("=", 1)
        alg, key = lhs.split(".", 1)
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        out.setdefault(alg, {})[key] = parsed
    return out


def main() -> None:
    import history  # benchmarks/history.py: record the comparison lines
    history.hook()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--algorithms", default="fedproto,fedtgp")
    p.add_argument("--htfllib", default=os.environ.get("HTFLLIB", "/tmp/htfllib"))
    p.add_argument("--set", action="append", default=[], metavar="ALG.KEY=VALUE",
                   help="a protofl algo option for one method, e.g. fedtgp.server_lr=0.1")
    p.add_argument("--json", help="write every seed's numbers to this file")
    p.add_argument("--htfllib-only", action="store_true",
                   help="run only HtFLlib's side (with --cache: fill it)")
    p.add_argument("--protofl-only", action="store_true",
                   help="run only protofl's side (with --cache: fill it; HtFLlib's cached "
                        "results are still shown)")
    p.add_argument("--cache", help="a JSON file of HtFLlib's results by (method, seed, rounds):"
                                   " and protofl's by (method, seed, rounds, options): read where "
                                   "present, else run and added")
    a = p.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    overrides = parse_overrides(a.set)
    checkout = Path(a.htfllib)
    have = (checkout / "system" / "flcore" / "servers" / "serverproto.py").exists()
    if a.protofl_only:
        have = False
    if not have:
        print(f"no HtFLlib checkout at {checkout}: protofl's side only")
    record: dict = {"rounds": a.rounds, "seeds": seeds, "overrides": overrides}
    cache = json.loads(Path(a.cache).read_text()) if a.cache and Path(a.cache).exists() else {}
    for alg in a.algorithms.split(","):
        rows = []
        for seed in seeds:
            start = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                tag = f"{alg}/{seed}/{a.rounds}"
                ours_tag = f"protofl:{tag}:{json.dumps(overrides.get(alg, {}), sort_keys=True)}"
                other = cache.get(tag)
                if ours_tag in cache and (other or not have or a.protofl_only):
                    acc, spr = cache[ours_tag]
                else:
                    acc, spr = run_protofl(alg, seed, a.rounds, Path(tmp), overrides,
                                           train=not a.htfllib_only)
                if not other and have and not a.protofl_only:
                    other = run_htfllib(alg, seed, a.rounds, Path(tmp), checkout)
                if a.cache:  # re-read: another run may have added to it meanwhile
                    cache = {**(json.loads(Path(a.cache).read_text())
                                if Path(a.cache).exists() else {}), **cache}
                    if other:
                        cache[tag] = other
                    if not math.isnan(acc):
                        cache[ours_tag] = [acc, spr]
                    Path(a.cache).write_text(json.dumps(cache))
            rows.append({"seed": seed, "protofl": acc, "protofl_spr": spr,
                         **({"htfllib": other["accuracy"], "htfllib_spr":
                             other["seconds_per_round"], "htfllib_curve": other["curve"],
                             "stubs": other["stubs"]} if other else {})})
            print(f"  {alg} seed {seed}: protofl {acc:.4f}"
                  + (f", htfllib {other['accuracy']:.4f}" if other else "")
                  + f" ({time.perf_counter() - start:.0f} s)", flush=True)
        record[alg] = rows
        if a.htfllib_only:
            continue
        ours = [r["protofl"] for r in rows]
        x = float(np.mean([r["protofl_spr"] for r in rows]))
        line = (f"[hetero {alg}, textures 16x16, {CLIENTS} clients Dir(0.1), {a.rounds} rounds]"
                f" vs htfllib: ")
        if not have:
            print(f"{line}protofl {x:.3f} s/round, other n/a")
            print(f"  accuracy over seeds {seeds}: protofl {np.mean(ours):.4f} ± "
                  f"{sd(ours):.4f}")
            continue
        theirs = [r["htfllib"] for r in rows]
        y = float(np.mean([r["htfllib_spr"] for r in rows]))
        print(f"{line}protofl {x:.3f} s/round, other {y:.3f} s/round, ratio {y / x:.2f}")
        m, lo, hi = paired([o - t for o, t in zip(ours, theirs)])
        print(f"  accuracy over seeds {seeds}: protofl {np.mean(ours):.4f} ± {sd(ours):.4f}, "
              f"htfllib {np.mean(theirs):.4f} ± {sd(theirs):.4f}; paired protofl - htfllib "
              f"{m:+.4f} (95% t-interval {lo:+.4f} .. {hi:+.4f}); ahead on "
              f"{sum(o > t for o, t in zip(ours, theirs))} of {len(rows)}"
              + (f" (stand-ins: {', '.join(rows[0]['stubs'])})" if rows[0]["stubs"] else ""))
    if a.json:
        Path(a.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        alg, seed, rounds, root, checkout = sys.argv[2:7]
        htfllib_worker(alg, int(seed), int(rounds), root, checkout)
    else:
        main()
