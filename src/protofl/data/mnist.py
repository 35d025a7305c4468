"""MNIST and Fashion-MNIST from their four IDX files (plain or .gz), parsed and checked here.

IDX: a 4-byte magic (two zero bytes, a type code, the number of dimensions), then one
big-endian uint32 per dimension, then the values in row-major order. Fashion-MNIST (Xiao et
al. 2017) has MNIST's file names, shapes and header; a file of the published size must have
the published content (``FASHION_PUBLISHED``), which tells it from MNIST's.

``idx_from_classic_pickle`` writes the four files from the classic ``mnist.pkl.gz`` (a
pickle of ``((x, y), (x, y), (x, y))``: 50,000 train, 10,000 validation, 10,000 test rows of
784 float32 pixels = byte / 256 and int64 labels), read with the restricted unpickler of
``protofl.data.cifar``. Every pixel is an exact multiple of 1/256, so the bytes come back
exactly; train + validation, in order, are MNIST's 60,000 training digits.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import pickle
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from protofl.config import DataConfig
from protofl.data.federated import FederatedData, from_partition
from protofl.data.images import PIXEL_MAX
from protofl.data.partition import capped, config_partition
from protofl.errors import ProtoflError

# IDX type code -> numpy dtype (big-endian where it matters)
IDX_TYPES = {0x08: np.dtype("u1"), 0x09: np.dtype("i1"), 0x0B: np.dtype(">i2"),
             0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
DEFAULT_CLIENTS = 1000
SIDE = 28
IDX_MAGIC = {3: 0x0803, 1: 0x0801}  # unsigned bytes, 3 or 1 dimensions
CLASSIC_SPLITS = ("train", "validation", "test")

# Debian's dataset-fashion-mnist installs the four .gz files here (data.root when null)
FASHION_ROOT = "/usr/share/datasets/fashion-mnist"
FASHION_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                   "Sneaker", "Bag", "Ankle boot")  # the labels 0..9 (the publisher's README)
FASHION_CLIENTS = 10  # NIID-Bench's federation (Li et al. 2022): 10 parties
# (size, MD5) of each uncompressed file as published for Fashion-MNIST (listed by several
# public loaders beside the README's MD5s of Zalando's .gz files; Debian recompressed the
# .gz files, so only their content can be compared)
FASHION_PUBLISHED = {
    "train-images-idx3-ubyte": (47040016, "f4a8712d7a061bf5bd6d2ca38dc4d50a"),
    "train-labels-idx1-ubyte": (60008, "9018921c3c673c538a1fc5bad174d6f9"),
    "t10k-images-idx3-ubyte": (7840016, "8181f5470baa50b63fa0f6fddb340f0a"),
    "t10k-labels-idx1-ubyte": (10008, "15d484375f8d13e6eb1aabb0c3f46965"),
}


def read_idx(path: str | Path, ndim: int | None = None,
             published: tuple[int, str] | None = None) -> np.ndarray:
    """The array an IDX file holds (gzip-compressed if the name ends in .gz).

    Raises ProtoflError naming the file on a wrong magic number, a different number of
    dimensions than ``ndim``, or a size that disagrees with the header. ``published``:
    (size, MD5) of the published file, uncompressed: content of that size must have that MD5
    (content of another size, e.g. a subset, is read as it is).
    """
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except FileNotFoundError:
        raise ProtoflError(f"IDX file {path} does not exist") from None
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise ProtoflError(f"IDX file {path} cannot be read: {e}") from None
    if published is not None and len(raw) == published[0]:
        got = hashlib.md5(raw).hexdigest()
        if got != published[1]:
            raise ProtoflError(f"IDX file {path} has the published file's size but not its "
                               f"content: MD5 {got} (uncompressed), expected {published[1]}")
    if len(raw) < 4:
        raise ProtoflError(f"IDX file {path} is truncated: {len(raw)} bytes, no header")
    zero, code, dims = struct.unpack(">HBB", raw[:4])
    if zero != 0 or code not in IDX_TYPES:
        raise ProtoflError(f"IDX file {path} has a wrong magic number 0x{raw[:4].hex()}; "
                           "expected 0x0000 then a type code (0x08 for unsigned bytes)")
    if ndim is not None and dims != ndim:
        raise ProtoflError(f"IDX file {path} has {dims} dimensions, expected {ndim} "
                           f"(magic 0x{raw[:4].hex()})")
    head = 4 + 4 * dims
    if len(raw) < head:
        raise ProtoflError(f"IDX file {path} is truncated inside its header")
    shape = struct.unpack(f">{dims}I", raw[4:head])
    dtype = IDX_TYPES[code]
    want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    have = len(raw) - head
    if have != want:
        what = "truncated" if have < want else "longer than its header says"
        raise ProtoflError(f"IDX file {path} is {what}: header {shape} needs {want} bytes of "
                           f"data, found {have}")
    return np.frombuffer(raw, dtype=dtype, offset=head).reshape(shape)


def find_idx(root: Path, stem: str, what: str = "MNIST") -> Path:
    """``stem`` in ``root``, plain or .gz, also with '.' for the last '-' (a common variant)."""
    alt = stem.replace("-idx", ".idx")  # train-images.idx3-ubyte style
    names = [stem, stem + ".gz", alt, alt + ".gz"]
    for name in names:
        if (root / name).is_file():
            return root / name
    raise ProtoflError(f"{what} file {stem}[.gz] not found in {root}; data.root must hold "
                       f"{', '.join(FILES.values())} (plain or .gz)")


def load_mnist(root: str | Path, what: str = "MNIST",
               published: dict[str, tuple[int, str]] | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test) of the four IDX files in ``root`` (``what``: the
    dataset's name in messages; ``published``: file stem -> (size, MD5), see ``read_idx``):
    images uint8 (N, H, W), labels int64 in 0..9."""
    root = Path(root).expanduser()
    if root.is_file():
        raise ProtoflError(f"data.root {root} is a file; {what}'s data.root is the folder "
                           f"that holds {', '.join(FILES.values())} (plain or .gz)")
    if not root.is_dir():
        raise ProtoflError(f"{what} folder {root} does not exist")
    published = published or {}
    out = []
    for split in ("train", "test"):
        istem, lstem = FILES[f"{split}_images"], FILES[f"{split}_labels"]
        ipath, lpath = find_idx(root, istem, what), find_idx(root, lstem, what)
        x = read_idx(ipath, ndim=3, published=published.get(istem))
        y = read_idx(lpath, ndim=1, published=published.get(lstem))
        for arr, p in ((x, ipath), (y, lpath)):
            if arr.dtype != np.uint8:
                raise ProtoflError(f"{what}: {p} holds {arr.dtype} values, expected unsigned "
                                   "bytes (magic 0x0803 / 0x0801)")
        if len(x) != len(y):
            raise ProtoflError(f"{what}: {ipath.name} holds {len(x)} images but {lpath.name} "
                               f"{len(y)} labels")
        if len(y) and (y.min() < 0 or y.max() > 9):
            raise ProtoflError(f"{what}: {lpath.name} has labels outside 0..9")
        out += [x, y.astype(np.int64)]
    if out[0].shape[1:] != out[2].shape[1:]:
        raise ProtoflError(f"{what}: train images are {out[0].shape[1:]}, test images "
                           f"{out[2].shape[1:]}")
    return out[0], out[1], out[2], out[3]


def idx_bytes(values: np.ndarray) -> bytes:
    """The IDX file of a uint8 array (1 or 3 dimensions): header, then the bytes."""
    values = np.ascontiguousarray(values, dtype=np.uint8)
    return (struct.pack(">I", IDX_MAGIC[values.ndim])
            + struct.pack(f">{values.ndim}I", *values.shape) + values.tobytes())


def write_idx_gz(path: Path, data: bytes) -> None:
    """``data`` gzip-compressed into ``path``, reproducibly (no name, mtime 0, level 9)."""
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw,
                                                mtime=0, compresslevel=9) as gz:
        gz.write(data)


def read_classic_pickle(path: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (images uint8 (N, 28, 28), labels uint8 (N,)) of the classic ``mnist.pkl.gz``'s
    three splits; ProtoflError naming the file on anything else (a refused global, a float
    that is not byte / 256, a shape or a label out of place)."""
    from protofl.data.cifar import _ArrayUnpickler, _Refused

    try:
        raw = gzip.decompress(Path(path).read_bytes())
        obj = _ArrayUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except _Refused as e:
        raise ProtoflError(f"{path} is not the classic MNIST pickle: {e}") from None
    except (OSError, EOFError, zlib.error, pickle.UnpicklingError, ValueError, TypeError,
            AttributeError, IndexError, KeyError, MemoryError, OverflowError) as e:
        raise ProtoflError(f"{path} is truncated or corrupt "
                           f"({type(e).__name__}: {e or 'unexpected end'})") from None
    if not (isinstance(obj, tuple) and len(obj) == 3
            and all(isinstance(p, tuple) and len(p) == 2 for p in obj)):
        raise ProtoflError(f"{path} holds a {type(obj).__name__}, expected the classic "
                           "((x, y), (x, y), (x, y)) of train, validation and test")
    out = []
    for split, (x, y) in zip(CLASSIC_SPLITS, obj):
        if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and x.ndim == 2
                and x.shape[1] == SIDE * SIDE and y.shape == (len(x),)
                and x.dtype.kind == "f" and y.dtype.kind in "iu"):
            raise ProtoflError(f"{path}: the {split} split is not N x 784 floats and N "
                               "integer labels")
        scaled = x.astype(np.float64) * 256
        pixels = np.rint(scaled)
        if len(x) and (not np.array_equal(scaled, pixels) or pixels.min() < 0
                       or pixels.max() > 255):
            raise ProtoflError(f"{path}: the {split} split has pixels that are not a byte / "
                               "256 (the classic pickle's scale); its bytes cannot be "
                               "recovered exactly")
        if len(y) and (y.min() < 0 or y.max() > 9):
            raise ProtoflError(f"{path}: the {split} split has labels outside 0..9")
        out.append((pixels.astype(np.uint8).reshape(-1, SIDE, SIDE), y.astype(np.uint8)))
    return out


def idx_from_classic_pickle(pkl: Path, folder: Path) -> dict[str, bytes]:
    """Write ``folder``'s four ``*-ubyte.gz`` from the classic pickle ``pkl`` (train =
    train + validation, in order); return {file name (uncompressed): its IDX bytes}."""
    (tx, ty), (vx, vy), (sx, sy) = read_classic_pickle(pkl)
    contents = {FILES["train_images"]: idx_bytes(np.concatenate([tx, vx])),
                FILES["train_labels"]: idx_bytes(np.concatenate([ty, vy])),
                FILES["test_images"]: idx_bytes(sx), FILES["test_labels"]: idx_bytes(sy)}
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in contents.items():
        write_idx_gz(folder / f"{name}.gz", data)
    return contents


def mnist_federation(cfg: DataConfig) -> FederatedData:
    """The seed's split: 1,000 clients (``num_clients``), ``classes_per_client`` = 2 digits
    each, power-law sizes (``gamma``), a 90/10 split per client; global test = t10k. Pixels
    stay uint8 (``scale`` 255).

    ``partition`` may name another scheme; ``max_samples`` caps the training pool (a seeded
    random subset).
    """
    x, y, x_test, y_test = load_mnist(cfg.root)
    keep = capped(len(y), cfg)
    parts = [keep[p] for p in config_partition(y[keep], cfg, "classes", DEFAULT_CLIENTS)]
    return from_partition("mnist", 10, x[:, None], torch.from_numpy(y), parts,
                          x_test[:, None], torch.from_numpy(y_test), cfg.local_test_fraction,
                          cfg.seed, scale=PIXEL_MAX)


def fashion_mnist_federation(cfg: DataConfig) -> FederatedData:
    """Fashion-MNIST from ``data.root`` (null: Debian's ``FASHION_ROOT``), the files of the
    published size checked against the published MD5s: the 60,000 training images partitioned
    (10 clients, Dirichlet ``alpha`` by default), the 10,000 t10k images as the global test
    set. Pixels stay uint8 (``scale`` 255); ``max_samples`` caps the training pool."""
    x, y, x_test, y_test = load_mnist(cfg.root or FASHION_ROOT, "Fashion-MNIST",
                                      FASHION_PUBLISHED)
    keep = capped(len(y), cfg)
    parts = [keep[p] for p in config_partition(y[keep], cfg, "dirichlet", FASHION_CLIENTS)]
    return from_partition("fashion-mnist", 10, x[:, None], torch.from_numpy(y), parts,
                          x_test[:, None], torch.from_numpy(y_test), cfg.local_test_fraction,
                          cfg.seed, list(FASHION_CLASSES), scale=PIXEL_MAX)
