"""Pascal VOC 2012 semantic segmentation as the seed's federated benchmark.

Layout: ``VOCdevkit/VOC2012/`` (or the folder itself, or ``VOC2012/`` under ``data.root``)
with ``JPEGImages/<id>.jpg``, ``SegmentationClass/<id>.png`` (palette PNGs of class indices,
255 = void/boundary) and ``ImageSets/Segmentation/{train,val}.txt``. When
``SegmentationClassAug/`` (plain 8-bit label PNGs, the SBD-augmented masks) is present its
masks are used (falling back to ``SegmentationClass/`` for an id it lacks), and its train
list ``ImageSets/Segmentation/train_aug.txt`` (or ``trainaug.txt``) when there is one.

The seed's subset is kept: images whose mask holds exactly one object class besides
background (void ignored). Labels are the 21 VOC classes (0 = background) or the seed's 5
macro classes (background, person, vehicles, household, animals). Images are resized
bilinearly and masks by nearest neighbour to ``data.image_size`` (default 128) and stored as
uint8 ``(N, 3, S, S)`` and ``(N, S, S)`` (255 kept); ``FederatedData.inputs`` standardises
the images a batch at a time with the ImageNet channel statistics. Training images are
partitioned with ``dirichlet_powerlaw`` over their object class (Dirichlet ``data.alpha``,
power-law sizes ``data.gamma`` = 3); the val list is the global test set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from protofl.config import ALPHA_SETTINGS
from protofl.data.federated import FederatedData, from_partition
from protofl.data.images import IMAGENET_MEAN, IMAGENET_STD, PIXEL_MAX
from protofl.data.partition import capped, config_partition
from protofl.data.voc import (
    MACRO_CLASSES,
    MACRO_OF,
    VOC_CLASSES,
    VOC_CLIENTS,
    VOC_SIZE,
    read_list,
    read_mask,
)
from protofl.errors import ProtoflError
from protofl.tasks import VOID

SEG_CLASSES = ("background", *VOC_CLASSES)  # mask values 0..20
SEG_MACRO_CLASSES = ("background", *MACRO_CLASSES)
AUG_TRAIN_LISTS = ("train_aug.txt", "trainaug.txt")


def alpha_setting(name: str) -> float:
    """The Dirichlet alpha of a named setting (``a0.01``, ``a0.1``, ``a1``)."""
    if name not in ALPHA_SETTINGS:
        raise ProtoflError(f"unknown alpha setting {name!r}; allowed: "
                           f"{', '.join(ALPHA_SETTINGS)}")
    return ALPHA_SETTINGS[name]


def macro_lut() -> np.ndarray:
    """256-entry table from VOC mask values to macro values (0 stays 0, 255 stays 255)."""
    lut = np.full(256, VOID, dtype=np.uint8)
    lut[0] = 0
    for i, name in enumerate(VOC_CLASSES, start=1):
        lut[i] = 1 + MACRO_CLASSES.index(MACRO_OF[name])
    return lut


@dataclass(frozen=True)
class VocLayout:
    """Where a VOC 2012 tree keeps its files."""

    base: Path
    aug: Path | None  # SegmentationClassAug/, when present
    train_list: Path
    val_list: Path

    def mask_path(self, image_id: str) -> tuple[Path, bool]:
        """(mask file, whether it is a SegmentationClassAug label PNG)."""
        if self.aug is not None:
            p = self.aug / f"{image_id}.png"
            if p.exists() or not (self.base / "SegmentationClass" / f"{image_id}.png").exists():
                return p, True
        return self.base / "SegmentationClass" / f"{image_id}.png", False

    def image_path(self, image_id: str) -> Path:
        return self.base / "JPEGImages" / f"{image_id}.jpg"


def voc_layout(root: str | Path) -> VocLayout:
    """Find the VOC2012 folder under ``root`` and its mask folders and lists."""
    root = Path(root)
    for base in (root, root / "VOC2012", root / "VOCdevkit" / "VOC2012"):
        aug = base / "SegmentationClassAug"
        has_masks = (base / "SegmentationClass").is_dir() or aug.is_dir()
        if (base / "JPEGImages").is_dir() and has_masks:
            sets = base / "ImageSets" / "Segmentation"
            train = sets / "train.txt"
            if aug.is_dir():
                train = next((sets / n for n in AUG_TRAIN_LISTS if (sets / n).is_file()), train)
            return VocLayout(base, aug if aug.is_dir() else None, train, sets / "val.txt")
    raise ProtoflError(f"no Pascal VOC 2012 folder at {root}: expected JPEGImages/ and "
                       "SegmentationClass/ (or SegmentationClassAug/) with "
                       "ImageSets/Segmentation/ (in it, VOC2012/ or VOCdevkit/VOC2012/)")


def image_size_of(path: Path) -> tuple[int, int]:
    """(width, height) from the image header (the pixels are not decoded)."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.size
    except FileNotFoundError:
        raise ProtoflError(f"image file {path} does not exist (listed in the split)") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise ProtoflError(f"image file {path} cannot be read ({e})") from None


def load_pair(image: Path, mask: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The image decoded, RGB, resized bilinearly, and its mask resized by nearest
    neighbour, both to ``size x size``: uint8 (3, S, S) and (S, S)."""
    from PIL import Image

    try:
        with Image.open(image) as im:
            im.draft("RGB", (size, size))  # JPEG: decode at a reduced scale when possible
            rgb = im.convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
    except (OSError, ValueError, SyntaxError) as e:
        raise ProtoflError(f"image file {image} cannot be read ({e})") from None
    m = Image.fromarray(mask).resize((size, size), Image.Resampling.NEAREST)
    return np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1), np.asarray(m, dtype=np.uint8)


def single_class_split(layout: VocLayout, list_path: Path, size: int
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """(images, masks, object class 1..20, ids) of a list's images holding one object class.

    Every listed image is checked (its mask readable and valid, its JPEG present and of the
    mask's size); only the kept ones are decoded.
    """
    xs, ys, labels, kept = [], [], [], []
    for image_id in read_list(list_path):
        path, aug = layout.mask_path(image_id)
        mask = read_mask(path, aug)
        jpg = layout.image_path(image_id)
        w, h = image_size_of(jpg)
        if (h, w) != mask.shape:
            raise ProtoflError(f"segmentation mask {path} is {mask.shape[1]}x{mask.shape[0]} "
                               f"but its image {jpg} is {w}x{h}")
        objects = np.setdiff1d(np.unique(mask), [0, VOID])
        if len(objects) != 1:
            continue
        x, y = load_pair(jpg, mask, size)
        xs.append(x)
        ys.append(y)
        labels.append(int(objects[0]))
        kept.append(image_id)
    if not kept:
        raise ProtoflError(f"Pascal VOC list {list_path}: no image holds exactly one object "
                           "class")
    return np.stack(xs), np.stack(ys), np.asarray(labels, dtype=np.int64), kept


def voc_segmentation(cfg, macro: bool = False) -> FederatedData:
    """The seed's federated VOC segmentation split (see the module docstring)."""
    layout = voc_layout(cfg.root)
    size = cfg.image_size or VOC_SIZE
    x, y, lab, _ = single_class_split(layout, layout.train_list, size)
    x_test, y_test, lab_test, _ = single_class_split(layout, layout.val_list, size)
    keep = capped(len(lab), cfg)
    x, y, lab = x[keep], y[keep], lab[keep]
    return mask_federation("voc_seg_macro" if macro else "voc_seg",
                           SEG_MACRO_CLASSES if macro else SEG_CLASSES, (x, y, lab),
                           (x_test, y_test, lab_test), cfg, VOC_CLIENTS,
                           macro_lut() if macro else None)


def mask_federation(name: str, names, train: tuple[np.ndarray, np.ndarray, np.ndarray],
                    test: tuple[np.ndarray, np.ndarray, np.ndarray], cfg, clients: int,
                    lut: np.ndarray | None = None) -> FederatedData:
    """A segmentation federation from uint8 images, masks and per-image object classes
    ``(x, y, labels)`` of both splits: masks and labels mapped through ``lut`` (a macro
    grouping) when given, clients by ``cfg``'s partition over the object class (Dirichlet
    with power-law sizes by default, ``clients`` of them), rows standardised per batch
    with ImageNet's statistics."""
    (x, y, lab), (x_test, y_test, lab_test) = train, test
    if lut is not None:
        y, y_test, lab, lab_test = lut[y], lut[y_test], lut[lab], lut[lab_test]
    parts = config_partition(lab, cfg, "dirichlet_powerlaw", clients)
    return from_partition(
        name, len(names), torch.from_numpy(x), torch.from_numpy(y), parts,
        torch.from_numpy(x_test), torch.from_numpy(y_test), cfg.local_test_fraction, cfg.seed,
        list(names), labels=torch.from_numpy(lab.astype(np.int64)),
        labels_test=torch.from_numpy(lab_test.astype(np.int64)),
        scale=PIXEL_MAX, mean=IMAGENET_MEAN, std=IMAGENET_STD)


def voc_seg_federation(cfg) -> FederatedData:
    """VOC 2012 single-object segmentation, 21 classes."""
    return voc_segmentation(cfg, macro=False)


def voc_seg_macro_federation(cfg) -> FederatedData:
    """VOC 2012 single-object segmentation, the seed's 5 macro classes."""
    return voc_segmentation(cfg, macro=True)
