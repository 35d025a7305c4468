"""Small image folders for site-mode tests: one PNG per sample, a class-dependent pattern
plus noise, so a tiny model can learn them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def write_images(folder: Path, cls: int, n: int, size: int = 8, mode: str = "L",
                 seed: int = 0) -> None:
    """``n`` images of class index ``cls`` into ``folder`` (a bright band at row ``cls``)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, cls])
    for i in range(n):
        a = rng.integers(0, 60, (size, size)).astype(np.uint8)
        a[(2 * cls) % size] = 230
        if mode == "RGB":
            a = np.stack([a, a // 2, 255 - a], -1)
        Image.fromarray(a).save(folder / f"{cls}_{i}.png")


def write_site(root: Path, counts: dict[str, int], classes: list[str], size: int = 8,
               mode: str = "L", seed: int = 0, test: dict[str, int] | None = None) -> Path:
    """An image folder ``root/<class>/`` with ``counts[name]`` images per class (the pattern
    follows the class's index in ``classes``), and ``root/train`` + ``root/test`` when
    ``test`` is given."""
    base = root / "train" if test else root
    for name, n in counts.items():
        write_images(base / name, classes.index(name) if name in classes else 7, n, size,
                     mode, seed)
    for name, n in (test or {}).items():
        write_images(root / "test" / name, classes.index(name), n, size, mode, seed + 100)
    return root
