"""Tiny-ImageNet-200 (the CS231n release, ``tiny-imagenet-200.zip``) in its folder layout.

::

    tiny-imagenet-200/
      wnids.txt                       the 200 WordNet ids, one a line: label = line number
      words.txt                       optional: "wnid<TAB>names" (the class names)
      train/<wnid>/images/*.JPEG      500 images a class
      val/images/*.JPEG               10,000 images ...
      val/val_annotations.txt         ... labelled "file<TAB>wnid<TAB>x0<TAB>y0<TAB>x1<TAB>y1"
      test/images/*.JPEG              no labels published: not read

The training images are partitioned over the clients; the labelled validation set is the
global test set. Images are 64 x 64 RGB (a few are greyscale JPEGs: converted to RGB), kept
as uint8 and decoded straight into the split arrays; ``data.image_size`` resizes them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from protofl.config import DataConfig
from protofl.data.cifar import CIFAR_CLIENTS, image_federation
from protofl.data.federated import FederatedData
from protofl.data.images import ImageRows
from protofl.data.partition import capped
from protofl.errors import ProtoflError

FOLDER = "tiny-imagenet-200"
SIDE = 64
SUFFIXES = (".jpeg", ".jpg")


def tiny_root(root: str | Path) -> Path:
    """``root`` or its ``tiny-imagenet-200`` subfolder, whichever holds ``wnids.txt``."""
    root = Path(root).expanduser()
    for folder in (root, root / FOLDER):
        if (folder / "wnids.txt").is_file():
            return folder
    if not root.is_dir():
        raise ProtoflError(f"Tiny-ImageNet folder {root} does not exist")
    raise ProtoflError(f"Tiny-ImageNet: no wnids.txt in {root} or {root / FOLDER}; data.root "
                       "must hold wnids.txt, train/<wnid>/images/ and val/val_annotations.txt")


def read_wnids(folder: Path) -> list[str]:
    """The class ids of ``wnids.txt`` in file order, checked (non-empty, no repeats)."""
    path = folder / "wnids.txt"
    try:
        wnids = [w.strip() for w in path.read_text(encoding="utf-8").splitlines() if w.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ProtoflError(f"Tiny-ImageNet {path} cannot be read: {e}") from None
    if not wnids:
        raise ProtoflError(f"Tiny-ImageNet {path} lists no class")
    seen = set()
    for i, w in enumerate(wnids, start=1):
        if w in seen or any(c.isspace() for c in w):
            raise ProtoflError(f"Tiny-ImageNet {path} line {i}: {w!r} is repeated or has spaces")
        seen.add(w)
    return wnids


def read_words(folder: Path, wnids: list[str]) -> list[str]:
    """The first name of each class from ``words.txt`` (the wnid itself where absent)."""
    path = folder / "words.txt"
    names = {}
    if path.is_file():
        try:
            for line in path.read_text(encoding="utf-8").splitlines():
                wnid, _, words = line.partition("\t")
                names[wnid.strip()] = words.split(",")[0].strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ProtoflError(f"Tiny-ImageNet {path} cannot be read: {e}") from None
    return [names.get(w) or w for w in wnids]


def _images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in SUFFIXES and p.is_file())


def train_files(folder: Path, wnids: list[str]) -> tuple[list[Path], np.ndarray]:
    """Every ``train/<wnid>/images/*.JPEG`` (sorted) and its label."""
    paths, labels = [], []
    for k, w in enumerate(wnids):
        d = folder / "train" / w / "images"
        if not d.is_dir():
            raise ProtoflError(f"Tiny-ImageNet: class {w} (wnids.txt) has no folder {d}")
        found = _images(d)
        if not found:
            raise ProtoflError(f"Tiny-ImageNet: {d} holds no .JPEG image")
        paths += found
        labels += [k] * len(found)
    return paths, np.asarray(labels, dtype=np.int64)


def val_files(folder: Path, wnids: list[str]) -> tuple[list[Path], np.ndarray]:
    """The images of ``val/val_annotations.txt`` and their labels, checked line by line."""
    path = folder / "val" / "val_annotations.txt"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ProtoflError(f"Tiny-ImageNet: {path} does not exist (the labelled val set is "
                           "the global test set)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ProtoflError(f"Tiny-ImageNet {path} cannot be read: {e}") from None
    index = {w: k for k, w in enumerate(wnids)}
    images = folder / "val" / "images"
    paths, labels = [], []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2 or not fields[0].strip():
            raise ProtoflError(f"Tiny-ImageNet {path} line {i}: expected "
                               f"'file<TAB>wnid<TAB>box', got {line[:60]!r}")
        name, wnid = fields[0].strip(), fields[1].strip()
        if wnid not in index:
            raise ProtoflError(f"Tiny-ImageNet {path} line {i}: wnid {wnid!r} is not in "
                               "wnids.txt")
        if Path(name).name != name:
            raise ProtoflError(f"Tiny-ImageNet {path} line {i}: {name!r} is not a file name")
        paths.append(images / name)
        labels.append(index[wnid])
    if not paths:
        raise ProtoflError(f"Tiny-ImageNet {path} has no annotation")
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise ProtoflError(f"Tiny-ImageNet: {len(missing)} image(s) of {path.name} missing, "
                           f"e.g. {missing[0]}")
    return paths, np.asarray(labels, dtype=np.int64)


def check_layout(root: Path) -> None:
    """The cheap part of the layout check: wnids.txt, one train folder per class, the val
    annotations (``protofl data fetch`` runs it on the unpacked archive)."""
    folder = tiny_root(root)
    wnids = read_wnids(folder)
    missing = [w for w in wnids if not (folder / "train" / w / "images").is_dir()]
    if missing:
        raise ProtoflError(f"Tiny-ImageNet: {len(missing)} class(es) of wnids.txt have no "
                           f"train/<wnid>/images/, e.g. {missing[0]}")
    if not (folder / "val" / "val_annotations.txt").is_file():
        raise ProtoflError(f"Tiny-ImageNet: {folder / 'val' / 'val_annotations.txt'} is missing")


def tinyimagenet_federation(cfg: DataConfig) -> FederatedData:
    """Tiny-ImageNet-200: the training images partitioned (20 clients, Dirichlet by default;
    ``max_samples`` caps the pool before any image is read), val as the global test set."""
    folder = tiny_root(cfg.root)
    wnids = read_wnids(folder)
    paths, y = train_files(folder, wnids)
    val, y_val = val_files(folder, wnids)
    keep = capped(len(y), cfg)
    size = cfg.image_size or SIDE
    x = ImageRows([paths[i] for i in keep], size, "RGB")
    x_test = ImageRows(val, size, "RGB")
    return image_federation("tinyimagenet", x, y[keep], x_test, y_val,
                            read_words(folder, wnids), cfg, CIFAR_CLIENTS)
