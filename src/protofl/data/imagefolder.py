"""A folder of images per class (``data.name: imagefolder``), the layout most sites have.

``root/<class>/*.png|jpg|...``: the class names are the folder names, sorted (label order);
with ``root/train/<class>/`` and ``root/test/<class>/`` the test folder is the global test set,
otherwise a stratified 20% of each class is. The pool is partitioned like the medical sets
(10 clients, Dirichlet ``alpha``). Images are RGB unless ``data.input_shape`` asks for one
channel or the first image is grey; all must have the same size unless ``data.image_size`` is set.
Pixels are kept as uint8 (``FederatedData.scale``), decoded straight into the split arrays.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from protofl.config import DataConfig
from protofl.data.federated import FederatedData
from protofl.data.images import GREY_MODES, ImageRows
from protofl.data.medical import TEST_FRACTION, dirichlet_federation, stratified_split
from protofl.data.partition import capped
from protofl.errors import ProtoflError

SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


def _subfolders(root: Path) -> list[Path]:
    return [d for d in sorted(root.iterdir()) if d.is_dir() and not d.name.startswith(".")]


def scan(root: Path, classes: list[str] | None = None) -> tuple[list[str], list[Path], np.ndarray]:
    """``(class names, image paths, labels)`` of ``root/<class>/``; with ``classes`` the label
    of a folder is its index there (a folder not in it is refused)."""
    folders = _subfolders(root)
    names = classes if classes is not None else [d.name for d in folders]
    paths: list[Path] = []
    labels: list[int] = []
    for d in folders:
        if d.name not in names:
            raise ProtoflError(f"image folder {root}: class folder {d.name!r} is not one of "
                               f"{', '.join(names)}")
        files = sorted(p for p in d.rglob("*") if p.suffix.lower() in SUFFIXES
                       and p.is_file() and not p.name.startswith("."))
        paths += files
        labels += [names.index(d.name)] * len(files)
    if not paths:
        raise ProtoflError(f"image folder {root} holds no images in class folders "
                           f"(root/<class>/*{'|'.join(SUFFIXES)})")
    return names, paths, np.asarray(labels, dtype=np.int64)


def image_mode(paths: list[Path], cfg: DataConfig) -> str:
    """``L`` when ``data.input_shape`` has one channel, ``RGB`` when three; otherwise ``L``
    if the first image is grey."""
    if cfg.input_shape:
        if cfg.input_shape[0] not in (1, 3):
            raise ProtoflError(f"data.input_shape {cfg.input_shape}: an image folder gives 1 "
                               "or 3 channels")
        return "L" if cfg.input_shape[0] == 1 else "RGB"
    from PIL import Image

    try:
        with Image.open(paths[0]) as im:
            return "L" if im.mode in GREY_MODES else "RGB"
    except Exception as e:  # Pillow raises many types on damaged files
        raise ProtoflError(f"image file {paths[0]} cannot be read ({type(e).__name__})") from None


def imagefolder_federation(cfg: DataConfig) -> FederatedData:
    """The federation of an image folder (see the module docstring)."""
    root = Path(cfg.root).expanduser()
    if not root.is_dir():
        raise ProtoflError(f"image folder: data.root {root} is not a folder")
    split = (root / "train").is_dir() and (root / "test").is_dir()
    names, paths, y = scan(root / "train" if split else root)
    if split:
        _, test_paths, y_test = scan(root / "test", names)
    keep = capped(len(paths), cfg)
    paths, y = [paths[i] for i in keep], y[keep]
    if not split:
        test = stratified_split(y, TEST_FRACTION, cfg.seed)
        test_paths, y_test = [p for p, t in zip(paths, test) if t], y[test]
        paths, y = [p for p, t in zip(paths, test) if not t], y[~test]
    mode = image_mode(paths, cfg)
    x = ImageRows(paths, cfg.image_size, mode)
    x_test: ImageRows | torch.Tensor = ImageRows(test_paths, cfg.image_size, mode)
    if not test_paths:
        x_test = torch.zeros((0, *x.row_shape), dtype=torch.uint8)
    elif x_test.row_shape != x.row_shape:
        raise ProtoflError(f"image folder {root}: test images are {x_test.row_shape[1:]}, "
                           f"training images {x.row_shape[1:]}; set data.image_size")
    return dirichlet_federation("imagefolder", tuple(names), x, y, x_test, y_test, cfg)
