"""Peak memory of loading a dataset: float32 rows, uint8 rows, and the memory-mapped cache.

    python benchmarks/data_memory.py --make /tmp/gen      # generate both sets, then measure
    python benchmarks/data_memory.py --root /tmp/gen      # measure already generated sets
    python benchmarks/data_memory.py --root /tmp/gen --datasets mnist --modes float,lean

Datasets (generated, of the real sizes, so the figures are those of the real files):

- ``mnist``: 60,000 + 10,000 28x28 digits in MNIST's IDX files (``workloads.
  write_mnist_like``), the seed's federation (1,000 clients);
- ``matek19``: 18,365 RGB TIFFs in Matek-19's 15 class folders (the real class counts), stored
  at 128x128 (the loader's size; the real files are 400x400 and are resized on reading, which
  changes the decoding time, not the memory).

Each measurement is a fresh subprocess that loads the dataset through ``load_dataset`` and
reports the growth of its peak resident memory (``VmHWM`` after loading minus ``VmRSS``
before, with torch imported), the resident memory kept afterwards (anonymous and file-backed
pages: memory-mapped rows are file-backed, and the kernel can drop them under pressure) and
the bytes of the stored rows. Modes: ``float`` (every split as float32, how protofl held data
before rows kept their source dtype), ``lean`` (uint8 rows in memory), ``mapped`` (uint8 rows
past a 0-byte budget: written to the on-disk cache while loading) and ``cached`` (the same
config again: mapped from that cache, nothing decoded). Run with ``PYTHONPATH`` at an older
source tree, mode ``float`` measures the old loaders.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MATEK_COUNTS = {"BAS": 79, "EBO": 78, "EOS": 424, "KSC": 15, "LYA": 11, "LYT": 3937,
                "MMZ": 15, "MOB": 26, "MON": 1789, "MYB": 42, "MYO": 3268, "NGB": 109,
                "NGS": 8484, "PMB": 18, "PMO": 70}  # 18,365 images
MODES = ("float", "lean", "mapped", "cached")


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def write_matek_like(root: Path, size: int = 128, seed: int = 0) -> None:
    """Smooth random RGB TIFFs (deflate-compressed) in Matek-19's class folders."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size] / size
    for c, n in MATEK_COUNTS.items():
        folder = root / "AML-Cytomorphology_LMU" / c
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            f = rng.random((3, 3)) * 6
            img = np.stack([np.sin(f[ch, 0] * xx + f[ch, 1] * yy + f[ch, 2]) for ch in range(3)],
                           -1)
            Image.fromarray(((img + 1) * 127.5).astype(np.uint8)).save(
                folder / f"{c}_{i:04d}.tiff", compression="tiff_deflate")


def config(name: str, root: Path):
    from protofl.config import DataConfig

    if name == "mnist":
        return DataConfig(name="mnist", root=str(root / "mnist"), num_clients=1000,
                          partition="classes")
    return DataConfig(name="matek19", root=str(root / "matek19"))


def child(name: str, root: Path, mode: str) -> dict:
    import torch

    from protofl.data.registry import load_dataset

    torch.set_num_threads(1)
    cfg = config(name, root)
    before = status("VmRSS")
    start = time.perf_counter()
    data = load_dataset(cfg) if mode == "float" else load_dataset(cfg, lean=True)
    seconds = time.perf_counter() - start
    xs = {id(t): t for t in (data.x_train, data.x_local_test, data.x_test)}.values()
    return {"dataset": name, "mode": mode, "seconds": seconds,
            "peak_growth": status("VmHWM") - before, "anon": status("RssAnon"),
            "file": status("RssFile"), "rows_bytes": sum(t.numel() * t.element_size() for t in xs),
            "dtype": str(data.x_train.dtype), "samples": int(len(data.y_train) +
                                                            len(data.y_local_test))}


def run(name: str, root: Path, mode: str, cache: Path) -> dict:
    env = {**os.environ, "PROTOFL_CACHE": str(cache)}
    if mode in ("mapped", "cached"):
        env["PROTOFL_DATA_BUDGET_MB"] = "0"
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, mode,
                          "--root", str(root)], capture_output=True, text=True, env=env)
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"dataset": name, "mode": mode,
            "error": (out.stderr.strip().splitlines() or ["no output"])[-1][:300]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--make", help="generate the datasets in this folder first")
    ap.add_argument("--root", help="folder holding mnist/ and matek19/")
    ap.add_argument("--datasets", default="mnist,matek19")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    root = Path(a.make or a.root or "")
    if a.child:
        print(json.dumps(child(a.child[0], root, a.child[1])), flush=True)
        return
    if a.make:
        from workloads import write_mnist_like

        (root / "mnist").mkdir(parents=True, exist_ok=True)
        write_mnist_like(root / "mnist")
        write_matek_like(root / "matek19")
    mib = 2 ** 20
    with tempfile.TemporaryDirectory() as cache:
        for name in a.datasets.split(","):
            for mode in a.modes.split(","):
                r = run(name, root, mode, Path(cache))
                if "error" in r:
                    print(f"{name:>8} {mode:>7}: FAILED ({r['error']})", flush=True)
                    continue
                print(f"{name:>8} {mode:>7}: {r['samples']} samples, rows {r['dtype']} "
                      f"{r['rows_bytes'] / mib:7.0f} MiB; loading peak +"
                      f"{r['peak_growth'] / mib:6.0f} MiB; kept: anon {r['anon'] / mib:6.0f} "
                      f"MiB, file-backed {r['file'] / mib:6.0f} MiB; {r['seconds']:.1f} s",
                      flush=True)


if __name__ == "__main__":
    main()
