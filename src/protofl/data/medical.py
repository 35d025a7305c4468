"""Medical image sets of the fedproin protocol: HAM10000, Matek-19 and MedMNIST files.

Each loader holds out a global test set, partitions the rest over ``num_clients`` clients
(default 10, Dirichlet ``alpha``; ``partition: iid`` for IID) and keeps images as
channels-first uint8 pixels (``scale`` 255), resized to ``image_size``, decoded straight into
the split arrays. ``max_samples`` caps the pool before any image is read (a seeded random
subset).
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import torch

from protofl.config import DataConfig
from protofl.data.federated import FederatedData, Source, from_partition
from protofl.data.images import PIXEL_MAX, ArrayRows, ImageRows
from protofl.data.partition import capped, config_partition
from protofl.errors import ProtoflError

HAM_CLASSES = ("akiec", "bcc", "bkl", "df", "mel", "nv", "vasc")
HAM_COLUMNS = ("lesion_id", "image_id", "dx")
HAM_METADATA = "HAM10000_metadata.csv"
MATEK_CLASSES = ("BAS", "EBO", "EOS", "KSC", "LYA", "LYT", "MMZ", "MOB", "MON", "MYB", "MYO",
                 "NGB", "NGS", "PMB", "PMO")
MEDICAL_SIZE = 128
MEDICAL_CLIENTS = 10
TEST_FRACTION = 0.2
TIFF_SUFFIXES = (".tif", ".tiff")


def _root(cfg: DataConfig, what: str) -> Path:
    root = Path(cfg.root)
    if not root.exists():
        raise ProtoflError(f"{what}: data.root {root} does not exist")
    return root


def dirichlet_federation(name: str, classes: tuple[str, ...], x: Source, y: np.ndarray,
                         x_test: Source, y_test: np.ndarray, cfg: DataConfig) -> FederatedData:
    """8-bit images with class labels, clients by ``cfg``'s partition (Dirichlet over
    ``MEDICAL_CLIENTS`` by default), the global test set as given."""
    parts = config_partition(y, cfg, "dirichlet", MEDICAL_CLIENTS)
    return from_partition(name, len(classes), x, torch.from_numpy(y), parts, x_test,
                          torch.from_numpy(y_test), cfg.local_test_fraction, cfg.seed,
                          list(classes), scale=PIXEL_MAX)


def _federate_images(name: str, classes: list[str], paths: list[Path], y: np.ndarray,
                     test: np.ndarray, cfg: DataConfig) -> FederatedData:
    """Federate the images (RGB, resized); ``test`` marks the global test set."""
    size = cfg.image_size or MEDICAL_SIZE
    x_pool = ImageRows([p for p, t in zip(paths, test) if not t], size, "RGB")
    x_test = ImageRows([p for p, t in zip(paths, test) if t], size, "RGB")
    return dirichlet_federation(name, classes, x_pool, y[~test], x_test, y[test], cfg)


def group_split(groups: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """A boolean test mask holding whole groups: groups are shuffled (seeded) and taken into
    the test set while it stays within ``fraction`` of the rows (at least one group)."""
    uniq, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
    order = np.random.default_rng(seed).permutation(len(uniq))
    target = fraction * len(groups)
    in_test = np.zeros(len(uniq), dtype=bool)
    total = 0
    for g in order:
        if total > 0 and total + counts[g] > target:
            continue
        in_test[g] = True
        total += counts[g]
    return in_test[inverse]


def stratified_split(y: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """A boolean test mask taking round(fraction * n_c) of each class (seeded), leaving at
    least one sample of each class in training."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(len(y), dtype=bool)
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        mask[idx[: min(int(round(fraction * len(idx))), len(idx) - 1)]] = True
    return mask


# ---------------------------------------------------------------- HAM10000
def read_ham_metadata(path: Path) -> tuple[list[str], list[str], np.ndarray]:
    """(lesion ids, image ids, labels) of the metadata CSV (comma- or tab-separated, as the
    Dataverse ``.tab`` copy), checked."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            first = f.readline()
            f.seek(0)
            rows = list(csv.DictReader(f, delimiter="\t" if "\t" in first else ","))
            header = rows[0].keys() if rows else []
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ProtoflError(f"HAM10000 metadata {path} cannot be read: {e}") from None
    missing = [c for c in HAM_COLUMNS if c not in header]
    if missing:
        raise ProtoflError(f"HAM10000 metadata {path} lacks column(s) {', '.join(missing)}; "
                           f"needed: {', '.join(HAM_COLUMNS)}")
    labels = []
    for i, r in enumerate(rows, start=2):
        dx = (r["dx"] or "").strip()
        if dx not in HAM_CLASSES:
            raise ProtoflError(f"HAM10000 metadata {path} line {i}: unknown dx {dx!r}; "
                               f"allowed: {', '.join(HAM_CLASSES)}")
        labels.append(HAM_CLASSES.index(dx))
    return ([r["lesion_id"].strip() for r in rows], [r["image_id"].strip() for r in rows],
            np.asarray(labels, dtype=np.int64))


def _find_file(root: Path, name: str, alternatives: tuple[str, ...] = ()) -> Path:
    """``name`` (else an alternative name) in ``root`` or any folder below it."""
    if root.is_file() and root.name in (name, *alternatives):
        return root
    for n in (name, *alternatives):
        if (root / n).is_file():
            return root / n
        found = sorted(p for p in root.rglob(n) if p.is_file())
        if found:
            return found[0]
    raise ProtoflError(f"{name} not found under {root}")


def ham10000_federation(cfg: DataConfig) -> FederatedData:
    """HAM10000 from ``HAM10000_metadata.csv`` and ``<image_id>.jpg`` files anywhere under
    the root (e.g. HAM10000_images_part_1/ and _part_2/); 7 classes (dx).

    The global test set (~20% of the images) holds whole lesions, so no lesion's images are
    on both sides."""
    root = _root(cfg, "HAM10000")
    meta = _find_file(root, HAM_METADATA, ("HAM10000_metadata.tab", "HAM10000_metadata"))
    lesions, images, y = read_ham_metadata(meta)
    root = root if root.is_dir() else root.parent
    if not images:
        raise ProtoflError(f"HAM10000 metadata {meta} has no rows")
    files = {p.stem: p for p in root.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg")}
    for image_id in images:
        if image_id not in files:
            raise ProtoflError(f"HAM10000 image {image_id}.jpg (listed in {meta.name}) not "
                               f"found under {root}")
    keep = capped(len(images), cfg)
    lesion_arr = np.asarray(lesions)[keep]
    y = y[keep]
    paths = [files[images[i]] for i in keep]
    test = group_split(lesion_arr, TEST_FRACTION, cfg.seed)
    return _federate_images("ham10000", HAM_CLASSES, paths, y, test, cfg)


# ---------------------------------------------------------------- Matek-19
def matek_class_folder(root: Path) -> Path:
    """The folder whose subfolders are the classes: the root, or its only subfolder (the
    archive's AML-Cytomorphology_LMU/)."""
    subs = [d for d in sorted(root.iterdir()) if d.is_dir() and not d.name.startswith(".")]
    if len(subs) == 1 and subs[0].name not in MATEK_CLASSES:
        return matek_class_folder(subs[0])
    return root


def matek19_federation(cfg: DataConfig) -> FederatedData:
    """Matek-19 (AML-Cytomorphology_LMU): a folder of TIFF images per class (15 classes);
    a stratified 20% of each class is the global test set (the data has no patient ids)."""
    root = _root(cfg, "Matek-19")
    if not root.is_dir():
        raise ProtoflError(f"Matek-19: data.root {root} is not a folder")
    base = matek_class_folder(root)
    paths, labels = [], []
    for d in sorted(base.iterdir()):
        if not d.is_dir() or d.name.startswith("."):
            continue
        if d.name not in MATEK_CLASSES:
            raise ProtoflError(f"Matek-19: unknown class folder {d}; allowed: "
                               f"{', '.join(MATEK_CLASSES)}")
        tiffs = sorted(p for p in d.iterdir() if p.suffix.lower() in TIFF_SUFFIXES)
        if not tiffs:
            raise ProtoflError(f"Matek-19: class folder {d} holds no .tif/.tiff images")
        paths += tiffs
        labels += [MATEK_CLASSES.index(d.name)] * len(tiffs)
    if not paths:
        raise ProtoflError(f"Matek-19: no class folders in {base}; expected folders named "
                           f"{', '.join(MATEK_CLASSES)}")
    keep = capped(len(paths), cfg)
    paths = [paths[i] for i in keep]
    y = np.asarray(labels, dtype=np.int64)[keep]
    test = stratified_split(y, TEST_FRACTION, cfg.seed)
    return _federate_images("matek19", MATEK_CLASSES, paths, y, test, cfg)


# ---------------------------------------------------------------- MedMNIST
def medmnist_file(root: Path) -> Path:
    """The .npz itself, or the only .npz in the folder."""
    if root.is_file():
        return root
    found = sorted(root.glob("*.npz"))
    if len(found) != 1:
        names = ", ".join(p.name for p in found) or "none"
        raise ProtoflError(f"MedMNIST: data.root {root} must be a .npz file or a folder with "
                           f"exactly one (found: {names})")
    return found[0]


def _npz_split(path: Path, z, split: str, cfg: DataConfig) -> tuple[np.ndarray, np.ndarray]:
    for key in (f"{split}_images", f"{split}_labels"):
        if key not in z.files:
            raise ProtoflError(f"MedMNIST file {path} lacks {key!r}; has {', '.join(z.files)}")
    try:
        x, y = z[f"{split}_images"], z[f"{split}_labels"]
    except Exception as e:  # a damaged archive raises many types (zlib.error, BadZipFile...)
        raise ProtoflError(f"MedMNIST file {path}: {split} arrays cannot be read: "
                           f"{type(e).__name__}") from None
    if y.ndim == 2 and y.shape[1] != 1:
        raise ProtoflError(f"MedMNIST file {path} is multi-label ({split}_labels {y.shape}); "
                           "only single-label sets are supported")
    if y.dtype.kind not in "iu" or y.ndim not in (1, 2) or not len(y) or y.min() < 0:
        raise ProtoflError(f"MedMNIST file {path}: {split}_labels must be a non-empty array of "
                           f"integers >= 0 (found {y.dtype}, {len(y)} labels)")
    y = y.reshape(-1).astype(np.int64)
    if len(x) != len(y) or x.dtype != np.uint8 or x.ndim not in (3, 4):
        raise ProtoflError(f"MedMNIST file {path}: {split}_images {x.shape} {x.dtype} does not "
                           f"match {len(y)} labels as uint8 (N, H, W[, 3])")
    return x, y


def medmnist_federation(cfg: DataConfig) -> FederatedData:
    """A MedMNIST ``.npz`` (train_*/val_*/test_* images and labels): the train split is
    partitioned, test is the global test set (val is not used: the clients' local test splits
    play its part); images at their native size unless ``image_size`` is set."""
    path = medmnist_file(_root(cfg, "MedMNIST"))
    try:
        z = np.load(path, allow_pickle=False)
    except Exception as e:  # as above
        raise ProtoflError(f"MedMNIST file {path} is not a readable .npz: "
                           f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise ProtoflError(f"MedMNIST file {path} is a single .npy array, not an .npz archive")
    with z:
        x, y = _npz_split(path, z, "train", cfg)
        x_test, y_test = _npz_split(path, z, "test", cfg)
    if cfg.image_size is None and x.shape[1:] != x_test.shape[1:]:
        raise ProtoflError(f"MedMNIST file {path}: train images are {x.shape[1:]}, test images "
                           f"{x_test.shape[1:]}; set data.image_size to resize them")
    keep = capped(len(y), cfg)
    x, y = x[keep], y[keep]
    num_classes = int(max(y.max(), y_test.max())) + 1
    classes = tuple(str(c) for c in range(num_classes))
    return dirichlet_federation(path.stem, classes, ArrayRows(x, cfg.image_size), y,
                     ArrayRows(x_test, cfg.image_size), y_test, cfg)
