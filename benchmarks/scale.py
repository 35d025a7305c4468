"""Round time and memory of protofl at 1,000 and 10,000 clients with K' = 100 active.

    python benchmarks/scale.py                  # 1,000 and 10,000 clients, K' = 100
    python benchmarks/scale.py --quick          # 1 warm-up + 2 timed rounds each
    python benchmarks/scale.py --clients 1000,10000 --per-round 10,100

Each configuration runs in a fresh subprocess: it builds Synthetic(1,1) with K clients
through the ordinary config path (``Experiment``), then runs FedAvg rounds with the
vectorized trainer (K' clients x 20 local steps of batch 10, no evaluation). Reported:

- ``s/round``: median wall time of the timed rounds (client sampling, training of the K'
  active clients, aggregation);
- ``dataset``: bytes of the federation's tensors (every split, each storage once);
- ``rounds peak - dataset``: peak RSS while the rounds run, minus the dataset. After loading,
  the heap pages glibc kept from the loader's freed temporaries are returned
  (``malloc_trim(0)``) and the kernel's peak counter is reset (``/proc/self/clear_refs``);
  RSS right after loading and after the trim are printed too;
- ``overall peak - dataset``: the same over the whole process, including building the data
  (the generator's float64 draws and the per-client lists it concatenates).

Memory that grows with K (not K') is only the dataset and per-client bookkeeping (offsets,
class counts); models, optimizer state and batches exist for the active clients only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _malloc_trim() -> None:
    """Give glibc's freed heap pages (the loader's temporaries) back to the kernel."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def child(clients: int, per_round: int, warmup: int, rounds: int, threads: int) -> dict:
    import torch

    from protofl.config import config_from_dict
    from protofl.engine.experiment import Experiment

    torch.set_num_threads(threads)
    cfg = config_from_dict({
        "algorithm": "fedavg", "trainer": "vectorized", "rounds": 10**6, "eval_every": 10**6,
        "checkpoint_every": 0, "data": {"name": "synthetic", "num_clients": clients},
        "clients": {"per_round": per_round, "local_steps": 20, "batch_size": 10, "lr": 0.05},
        "metrics": {"amm": False, "dissimilarity_clients": 0},
    })
    start = time.perf_counter()
    exp = Experiment(cfg)
    load_s = time.perf_counter() - start
    d = exp.data
    seen, dataset = set(), 0
    for t in (d.x_train, d.y_train, d.x_local_test, d.y_local_test, d.x_test, d.y_test):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            dataset += t.untyped_storage().nbytes()
    overall_before = _status("VmHWM")
    rss_loaded = _status("VmRSS")
    _malloc_trim()
    rss_trimmed = _status("VmRSS")
    reset = _reset_peak()
    times = []
    for _ in range(warmup + rounds):
        t0 = time.perf_counter()
        exp.step()
        times.append(time.perf_counter() - t0)
    assert exp.trainer.name == "vectorized"
    return {"clients": clients, "per_round": per_round, "samples": int(d.train_sizes.sum()),
            "load_s": load_s, "times": times[warmup:],
            "median": statistics.median(times[warmup:]), "dataset": dataset,
            "rounds_peak": _status("VmHWM") if reset else None,
            "overall_peak": max(overall_before, _status("VmHWM")), "rss_loaded": rss_loaded,
            "rss_trimmed": rss_trimmed, "rss_end": _status("VmRSS")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1000,10000")
    ap.add_argument("--per-round", default="100")
    ap.add_argument("--quick", action="store_true", help="1 warm-up + 2 timed rounds")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    warmup = a.warmup if a.warmup is not None else 1
    rounds = a.rounds if a.rounds is not None else (2 if a.quick else 5)
    if a.child:
        print(json.dumps(child(*a.child, warmup, rounds, a.threads)), flush=True)
        return
    mib = 2**20
    print(f"Synthetic(1,1), FedAvg, vectorized trainer, 20 local steps of batch 10, torch threads "
          f"{a.threads}; {warmup} warm-up + {rounds} timed rounds; medians")
    for k in [int(v) for v in a.clients.split(",")]:
        for kp in [int(v) for v in a.per_round.split(",")]:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", str(k), str(kp),
                   "--warmup", str(warmup), "--rounds", str(rounds), "--threads", str(a.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            if not lines:
                err = (out.stderr.strip().splitlines() or ["no output"])[-1]
                print(f"K={k:>6} K'={kp:>4}: FAILED ({err})", flush=True)
                continue
            r = json.loads(lines[-1])
            rounds_peak = ("n/a" if r["rounds_peak"] is None else
                           f"{(r['rounds_peak'] - r['dataset']) / mib:.0f} MiB")
            print(f"K={k:>6} K'={kp:>4}: {r['median']:.3f} s/round, {r['samples']:,} samples, "
                  f"dataset {r['dataset'] / mib:.0f} MiB, rounds peak - dataset {rounds_peak}, "
                  f"overall peak - dataset {(r['overall_peak'] - r['dataset']) / mib:.0f} MiB "
                  f"(load {r['load_s']:.1f} s; RSS - dataset after load "
                  f"{(r['rss_loaded'] - r['dataset']) / mib:.0f} MiB, after malloc_trim "
                  f"{(r['rss_trimmed'] - r['dataset']) / mib:.0f} MiB, after the rounds "
                  f"{(r['rss_end'] - r['dataset']) / mib:.0f} MiB)", flush=True)


if __name__ == "__main__":
    main()
