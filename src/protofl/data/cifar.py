"""CIFAR-10 and CIFAR-100 from their published python-version batches, and ``cifar_tiny``, an
embedded CIFAR-like stand-in that needs no download.

The batches (https://www.cs.toronto.edu/~kriz/cifar.html) are pickled dicts with byte-string
keys: ``b'data'``, a uint8 array N x 3072 whose rows hold the red, green then blue planes of a
32 x 32 image in row-major order, and the labels, ``b'labels'`` (CIFAR-10: ``data_batch_1`` ..
``data_batch_5`` and ``test_batch``, names in ``batches.meta``) or ``b'fine_labels'`` and
``b'coarse_labels'`` (CIFAR-100: ``train`` and ``test``, names in ``meta``).

A pickle can run code when loaded, so the batches are read with a restricted unpickler that
resolves only the numpy names a pickled array needs (``_reconstruct``, or ``_frombuffer``
at protocol 5, ``ndarray``, ``dtype``) and a latin-1-only ``_codecs.encode`` (Python 3's
protocol-2 bytes); any other global (``os.system``, ``builtins.eval``, ...) is refused before
it is called. ``protofl data fetch`` also verifies the archive's published MD5 first.

Pixels stay uint8 (``scale`` 255); ``mean``/``std`` are the per-channel statistics of the
clients' pool (the official training set), so inputs are standardised per channel.
"""

from __future__ import annotations

import io
import math
import pickle
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from protofl.config import DataConfig
from protofl.data.federated import FederatedData, from_partition
from protofl.data.images import PIXEL_MAX
from protofl.data.partition import capped, config_partition
from protofl.errors import ProtoflError

SIDE = 32
ROW = 3 * SIDE * SIDE  # 3072 bytes a row
CIFAR_CLIENTS = 20  # the FedTGP / PFLlib federation size
STATS_CHUNK = 8192  # rows a step when computing channel statistics


@dataclass(frozen=True)
class Variant:
    """One of the two published layouts: the archive's folder, the batch files, the meta
    file, the label and class-name keys and the class count."""

    name: str
    folder: str
    train: tuple[str, ...]
    test: str
    meta: str
    label_key: bytes
    names_key: bytes
    classes: int


CIFAR10 = Variant("CIFAR-10", "cifar-10-batches-py", tuple(f"data_batch_{i}" for i in range(1, 6)),
                  "test_batch", "batches.meta", b"labels", b"label_names", 10)
CIFAR100 = Variant("CIFAR-100", "cifar-100-python", ("train",), "test", "meta",
                   b"fine_labels", b"fine_label_names", 100)
COARSE_CLASSES = 20  # CIFAR-100's superclasses (b'coarse_labels')


# ---------------------------------------------------------------- safe unpickling
class _Refused(pickle.UnpicklingError):
    """The pickle names a global that a CIFAR batch does not need."""


_RECONSTRUCT = np.empty(0).__reduce__()[0]  # numpy's array reconstructor, whatever its module
_FROMBUFFER = np.empty(0).__reduce_ex__(5)[0]  # what pickle protocol 5 uses instead


def _latin1(text: str, encoding: str) -> bytes:
    """``_codecs.encode`` as Python 3 uses it to pickle bytes at protocol 2, latin-1 only."""
    if encoding != "latin1":
        raise _Refused(f"refused codec {encoding!r} (only latin1 is allowed)")
    return text.encode("latin1")


_ALLOWED = {("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,  # numpy < 2, Python 2
            ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,  # numpy >= 2
            ("numpy.core.numeric", "_frombuffer"): _FROMBUFFER,
            ("numpy._core.numeric", "_frombuffer"): _FROMBUFFER,
            ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype,
            ("_codecs", "encode"): _latin1}


class _ArrayUnpickler(pickle.Unpickler):
    """Resolves only the globals a pickled numpy array needs; anything else is refused."""

    def find_class(self, module: str, name: str):
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise _Refused(f"refused to load global {module}.{name} (only numpy arrays are "
                           "allowed)") from None


def load_batch(path: Path) -> dict:
    """A CIFAR batch file as its dict (byte-string keys), read with the restricted
    unpickler; ProtoflError naming the file when it is missing, truncated or not a dict."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ProtoflError(f"CIFAR batch {path} does not exist") from None
    except OSError as e:
        raise ProtoflError(f"CIFAR batch {path} cannot be read: {e}") from None
    try:
        obj = _ArrayUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except _Refused as e:
        raise ProtoflError(f"CIFAR batch {path} is not a plain CIFAR batch: {e}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, MemoryError, OverflowError) as e:  # truncated or garbled
        raise ProtoflError(f"CIFAR batch {path} is truncated or corrupt "
                           f"({type(e).__name__}: {e or 'unexpected end'})") from None
    if not isinstance(obj, dict):
        raise ProtoflError(f"CIFAR batch {path} holds a {type(obj).__name__}, expected a dict")
    return obj


def _labels(batch: dict, key: bytes, n: int, classes: int, path: Path) -> np.ndarray:
    if key not in batch:
        raise ProtoflError(f"CIFAR batch {path} has no {key!r} entry")
    try:
        y = np.asarray(batch[key])
    except (TypeError, ValueError) as e:
        raise ProtoflError(f"CIFAR batch {path}: {key!r} is not a list of labels ({e})") from None
    if y.ndim != 1 or len(y) != n or (n and y.dtype.kind not in "iu"):
        raise ProtoflError(f"CIFAR batch {path}: {key!r} holds {y.shape} {y.dtype} values, "
                           f"expected {n} integer labels (one per row of b'data')")
    if n and (y.min() < 0 or y.max() >= classes):
        raise ProtoflError(f"CIFAR batch {path}: {key!r} has labels in {y.min()}..{y.max()}, "
                           f"outside 0..{classes - 1}")
    return y.astype(np.int64)


def read_batch(path: Path, variant: Variant) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 (N, 3, 32, 32), labels int64 (N,)) of one batch file, checked."""
    batch = load_batch(path)
    if b"data" not in batch:
        raise ProtoflError(f"CIFAR batch {path} has no b'data' entry (keys: "
                           f"{', '.join(repr(k) for k in batch)})")
    x = batch[b"data"]
    if not isinstance(x, np.ndarray) or x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != ROW:
        got = f"{x.shape} {x.dtype}" if isinstance(x, np.ndarray) else type(x).__name__
        raise ProtoflError(f"CIFAR batch {path}: b'data' is {got}, expected uint8 N x {ROW} "
                           "(32 x 32 RGB rows)")
    y = _labels(batch, variant.label_key, len(x), variant.classes, path)
    if variant is CIFAR100 and b"coarse_labels" in batch:
        _labels(batch, b"coarse_labels", len(x), COARSE_CLASSES, path)
    return x.reshape(len(x), 3, SIDE, SIDE), y


def batch_folder(root: str | Path, variant: Variant) -> Path:
    """The folder holding ``variant``'s batch files: ``root`` itself or its
    ``cifar-10-batches-py``/``cifar-100-python`` subfolder (the archive's top folder)."""
    root = Path(root).expanduser()
    for folder in (root, root / variant.folder):
        if (folder / variant.test).is_file():
            return folder
    if not root.is_dir():
        raise ProtoflError(f"{variant.name} folder {root} does not exist")
    raise ProtoflError(f"{variant.name}: no {variant.test} in {root} or {root / variant.folder}; "
                       f"data.root must hold {', '.join(variant.train)} and {variant.test}")


def check_layout(root: Path, variant: Variant) -> Path:
    """ProtoflError naming the first batch file missing from ``root``; else its folder."""
    folder = batch_folder(root, variant)
    missing = [n for n in (*variant.train, variant.test) if not (folder / n).is_file()]
    if missing:
        raise ProtoflError(f"{variant.name} folder {folder} lacks {', '.join(missing)}")
    return folder


def check_cifar10(root: Path) -> None:
    check_layout(root, CIFAR10)


def check_cifar100(root: Path) -> None:
    check_layout(root, CIFAR100)


def class_names(folder: Path, variant: Variant) -> list[str]:
    """The class names of the meta file, or ``0..C-1`` when it is absent."""
    path = folder / variant.meta
    if not path.is_file():
        return [str(c) for c in range(variant.classes)]
    names = load_batch(path).get(variant.names_key)
    if not isinstance(names, list) or len(names) != variant.classes:
        raise ProtoflError(f"{variant.name} meta file {path} has no list of {variant.classes} "
                           f"{variant.names_key!r}")
    return [n.decode("utf-8", "replace") if isinstance(n, bytes) else str(n) for n in names]


def load_cifar(root: str | Path, variant: Variant
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """(x_train, y_train, x_test, y_test, class names); images uint8 (N, 3, 32, 32)."""
    folder = check_layout(Path(root), variant)
    parts = [read_batch(folder / n, variant) for n in variant.train]
    x_test, y_test = read_batch(folder / variant.test, variant)
    x = np.concatenate([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
    y = np.concatenate([p[1] for p in parts])
    return x, y, x_test, y_test, class_names(folder, variant)


# ---------------------------------------------------------------- federations
def channel_stats(xs: list[torch.Tensor]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and (population) std of uint8 images ``(N, C, H, W)`` pooled over
    ``xs``, in [0, 1] units, exact: from a histogram of the 256 pixel values per channel."""
    channels = xs[0].shape[1]
    hist = np.zeros((channels, 256), dtype=np.int64)
    for x in xs:
        for a in range(0, len(x), STATS_CHUNK):
            block = x[a:a + STATS_CHUNK].numpy()
            for c in range(channels):
                hist[c] += np.bincount(block[:, c].ravel(), minlength=256)
    v = np.arange(256, dtype=np.float64) / PIXEL_MAX
    n = hist.sum(1)
    if not n.all():
        raise ProtoflError("channel statistics need at least one image")
    mean = hist @ v / n
    var = np.maximum(hist @ (v * v) / n - mean ** 2, 0.0)
    std = np.sqrt(var)
    std = np.where(std > 0, std, 1.0)  # a constant channel is only centred
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


def standardised(fed: FederatedData) -> FederatedData:
    """``fed`` with ``mean``/``std`` set to the channel statistics of the clients' rows."""
    mean, std = channel_stats([fed.x_train, fed.x_local_test])
    return replace(fed, mean=mean, std=std)


def image_federation(name: str, x, y: np.ndarray, x_test, y_test: np.ndarray,
                     names: list[str], cfg: DataConfig, clients: int) -> FederatedData:
    """uint8 images (an array or a ``Rows`` source, already capped by ``max_samples``)
    partitioned by ``cfg`` (Dirichlet over ``clients`` by default), the global test set as
    given, standardised per channel."""
    parts = config_partition(y, cfg, "dirichlet", clients)
    fed = from_partition(name, len(names), x, torch.from_numpy(y), parts, x_test,
                         torch.from_numpy(y_test), cfg.local_test_fraction, cfg.seed,
                         list(names), scale=PIXEL_MAX)
    return standardised(fed)


def _capped_federation(name: str, x: np.ndarray, y: np.ndarray, x_test: np.ndarray,
                       y_test: np.ndarray, names: list[str], cfg: DataConfig,
                       clients: int) -> FederatedData:
    keep = capped(len(y), cfg)
    if len(keep) < len(y):
        x, y = x[keep], y[keep]
    return image_federation(name, x, y, x_test, y_test, names, cfg, clients)


def _check_size(cfg: DataConfig, name: str) -> None:
    if cfg.image_size not in (None, SIDE):
        raise ProtoflError(f"config: data.image_size = {cfg.image_size}, but {name} images are "
                           f"{SIDE} x {SIDE}; leave it null")


def cifar10_federation(cfg: DataConfig) -> FederatedData:
    """CIFAR-10: the 50,000 training images partitioned (20 clients, Dirichlet by default),
    the 10,000 of ``test_batch`` as the global test set."""
    _check_size(cfg, "CIFAR-10")
    x, y, xt, yt, names = load_cifar(cfg.root, CIFAR10)
    return _capped_federation("cifar10", x, y, xt, yt, names, cfg, CIFAR_CLIENTS)


def cifar100_federation(cfg: DataConfig) -> FederatedData:
    """CIFAR-100 with its 100 fine labels: ``train`` partitioned, ``test`` global."""
    _check_size(cfg, "CIFAR-100")
    x, y, xt, yt, names = load_cifar(cfg.root, CIFAR100)
    return _capped_federation("cifar100", x, y, xt, yt, names, cfg, CIFAR_CLIENTS)


# ---------------------------------------------------------------- cifar_tiny (no download)
TINY_CLASSES = ("red-horizontal", "orange-vertical", "yellow-diagonal", "green-antidiagonal",
                "cyan-checker", "blue-rings", "violet-dots", "magenta-fine", "grey-blob",
                "brown-cross")
TINY_TRAIN, TINY_TEST, TINY_CLIENTS = 600, 200, 10
TINY_RANDOM_HUE = 0.5  # share of images in a random colour: the texture must be learnt
TINY_TRAIN_SEED, TINY_TEST_SEED = 11, 12  # the set is fixed; data.seed only moves the partition


def _pattern(k: int, u: np.ndarray, v: np.ndarray, period: np.ndarray) -> np.ndarray:
    """Texture of class ``k`` in [0, 1] at pixel offsets u, v (period in pixels)."""
    w = 2 * math.pi / period
    waves = {0: np.sin(w * v), 1: np.sin(w * u), 2: np.sin(w * (u + v) / math.sqrt(2)),
             3: np.sin(w * (u - v) / math.sqrt(2)),
             4: np.sign(np.sin(w * u)) * np.sign(np.sin(w * v)),
             5: np.sin(w * np.hypot(u, v)), 6: np.cos(w * u) * np.cos(w * v),
             7: np.sin(2.5 * w * u) * np.sin(2.5 * w * v),
             8: 1.0 - 2.0 * np.exp(-(u * u + v * v) / (2 * (period * 0.8) ** 2)),
             9: np.where((np.abs(u) < period / 3) | (np.abs(v) < period / 3), 1.0, -1.0)}
    return 0.5 + 0.5 * waves[k]


def generate_tiny_images(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` 32 x 32 RGB images ``(uint8 (n, 3, 32, 32), labels int64 (n,))``: class k is a
    texture (stripes of one orientation, checks, rings, dots, ...) with a random phase,
    period, brightness and pixel noise, in its class's colour (half of the images: in a
    random colour, so colour alone does not tell the class). Deterministic from ``seed``."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % len(TINY_CLASSES)
    rng.shuffle(labels)
    yy, xx = np.meshgrid(np.arange(SIDE, dtype=np.float64), np.arange(SIDE, dtype=np.float64),
                         indexing="ij")
    hue = np.linspace(0.0, 0.9, len(TINY_CLASSES))
    out = np.empty((n, 3, SIDE, SIDE), dtype=np.float64)
    for i, k in enumerate(labels):
        cx, cy = rng.uniform(0, SIDE, 2)
        period = rng.uniform(5.0, 9.0)
        t = _pattern(int(k), xx - cx, yy - cy, period)
        h = hue[k] + rng.uniform(-0.02, 0.02) if rng.random() >= TINY_RANDOM_HUE else rng.random()
        fg = _rgb(h, rng.uniform(0.6, 1.0))
        bg = fg * rng.uniform(0.15, 0.4)
        img = bg[:, None, None] + (fg - bg)[:, None, None] * t[None]
        out[i] = img * rng.uniform(0.8, 1.1) + rng.normal(0, 0.05, img.shape)
    images = np.clip(np.rint(out * 255), 0, 255).astype(np.uint8)
    return images, labels.astype(np.int64)


def _rgb(h: float, value: float) -> np.ndarray:
    """A saturated colour of hue ``h`` and the given value (the usual HSV-to-RGB formula)."""
    k = (np.array([5.0, 3.0, 1.0]) + 6 * (h % 1.0)) % 6
    return value * (1 - 0.8 * np.clip(np.minimum(k, 4 - k), 0, 1))


def cifar_tiny_federation(cfg: DataConfig) -> FederatedData:
    """The embedded stand-in: 600 training images (10 clients, Dirichlet by default) and 200
    test images, 10 classes, 32 x 32 RGB, uint8 like CIFAR."""
    _check_size(cfg, "cifar_tiny")
    x, y = generate_tiny_images(TINY_TRAIN, TINY_TRAIN_SEED)
    xt, yt = generate_tiny_images(TINY_TEST, TINY_TEST_SEED)
    return _capped_federation("cifar_tiny", x, y, xt, yt, list(TINY_CLASSES), cfg, TINY_CLIENTS)
