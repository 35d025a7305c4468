"""Peak memory of training rounds of the seed's MNIST protocol: rows kept as uint8 and turned
into inputs per batch (how protofl trains now) against rows decoded to float32 up front (how it
trained before), for a trainer.

    python benchmarks/train_memory.py                       # sequential and auto, 2 epochs
    python benchmarks/train_memory.py --trainers auto --epochs 5 --rounds 2

Each (rows, trainer) pair is a fresh subprocess: it builds the experiment of
``configs/mnist.yaml`` on generated MNIST files (``workloads.write_mnist_like``), runs
``--rounds`` rounds with the default metrics and reports the peak proportional set size of
the process and its worker processes (sampled every 50 ms, as ``speed.py`` does), the peak
while loading and the bytes of the stored rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def child(rows: str, trainer: str, epochs: int, rounds: int, root: str) -> dict:
    import torch
    from memory import TreeSampler
    from workloads import mnist_experiment

    torch.set_num_threads(1)
    with TreeSampler(proportional=True) as mem:
        exp = mnist_experiment(root, epochs, rounds, device="cpu")
        if rows == "float":
            exp.data = exp.train_data = exp.data.decoded()
        if trainer != "auto":
            from protofl.engine import trainers

            exp.trainer = trainers.make(trainer, exp.alg.model, "cpu", 1)
        loaded = mem.peak
        for _ in range(rounds):
            exp.step()
        exp.close()
    return {"rows": rows, "trainer": exp.trainer.name, "loading_peak": loaded,
            "peak": mem.peak, "row_bytes": exp.data.nbytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainers", default="sequential,auto")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], a.epochs, a.rounds, a.child[2])))
        return
    from workloads import write_mnist_like

    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [here, *filter(None, [os.environ.get("PYTHONPATH")])])}
    print(f"seed's MNIST protocol, {a.rounds} round(s) of {a.epochs} local epochs; peak PSS of "
          "the process and its workers")
    with tempfile.TemporaryDirectory() as root:
        write_mnist_like(root)
        for trainer in a.trainers.split(","):
            for rows in ("float", "lean"):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", rows, trainer, root, "--epochs",
                     str(a.epochs), "--rounds", str(a.rounds)],
                    capture_output=True, text=True, env={**env, "PROTOFL_CACHE": root})
                lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
                if not lines:
                    print(f"{trainer} {rows}: FAILED {out.stderr.strip().splitlines()[-1:]}")
                    continue
                r = json.loads(lines[-1])
                print(f"{r['trainer']:>10} {rows:>5} rows ({r['row_bytes'] / 2**20:.0f} MiB): "
                      f"loading peak {r['loading_peak'] / 2**20:.0f} MiB, peak "
                      f"{r['peak'] / 2**20:.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
