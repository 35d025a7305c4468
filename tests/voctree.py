"""A tiny Pascal VOC 2012 tree in the real layout for the loader tests: palette-PNG masks,
random JPEGs of the masks' size, and the split lists."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def palette_png(path, mask) -> None:
    """``mask`` (class indices, 255 void) saved as VOC saves it: a palette (P) PNG."""
    im = Image.fromarray(np.asarray(mask).astype(np.uint8), mode="P")
    pal = np.zeros((256, 3), np.uint8)
    pal[1:21] = np.arange(1, 21)[:, None] * 12
    pal[255] = (224, 224, 192)  # VOC's void colour
    im.putpalette(pal.reshape(-1).tolist())
    im.save(path)


def write_tree(root: Path, masks: dict[str, dict[str, np.ndarray]]) -> Path:
    """``root/VOCdevkit/VOC2012`` with ``masks`` (split -> image id -> mask), a random image
    per mask (seeded) and the split lists; returns the VOC2012 folder."""
    base = Path(root) / "VOCdevkit" / "VOC2012"
    for d in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (base / d).mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, items in masks.items():
        for image_id, mask in items.items():
            palette_png(base / "SegmentationClass" / f"{image_id}.png", mask)
            Image.fromarray(rng.integers(0, 256, (*mask.shape, 3)).astype(np.uint8)).save(
                base / "JPEGImages" / f"{image_id}.jpg")
        (base / "ImageSets" / "Segmentation" / f"{split}.txt").write_text(
            "\n".join(items) + "\n")
    return base
