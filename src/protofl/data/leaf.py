"""LEAF's JSON format and the seed's FEMNIST and CelebA federations.

A LEAF file is ``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...],
"y": [...]}}}``; a dataset is one or more such files, usually in ``train/`` and ``test/``
folders holding each user's train and test samples (or ``all_data/`` before splitting).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch

from protofl.config import DataConfig
from protofl.data.federated import FederatedData, Source, from_ranges, gather, to_disk
from protofl.data.images import PIXEL_MAX, ImageRows
from protofl.errors import ProtoflError

UserData = dict[str, tuple[np.ndarray | list, np.ndarray]]

FEMNIST_FIRST = 36  # LEAF's 62 classes: 0-9 digits, 10-35 'A'-'Z', 36-61 'a'-'z'
FEMNIST_LETTERS = "abcdefghij"
FEMNIST_CLIENTS = 200
FEMNIST_CLASSES_PER_CLIENT = 5
CELEBA_SIZE = 84
MAX_CLASSES = 100_000  # a generic LEAF file's labels must lie below this (0 .. max label)


def read_leaf(folder: str | Path, labels: Iterable[int] | None = None) -> UserData:
    """Every user of every ``*.json`` file in ``folder`` (files in name order, users in file
    order; a user found in several files gets their samples concatenated).

    Numeric ``x`` becomes a float32 array, string ``x`` (file names) stays a list; ``y`` is an
    int64 array. With ``labels``, only samples with those labels are kept (applied per file,
    so a big dataset never sits in memory as JSON lists all at once).
    """
    folder = Path(folder)
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    if not files:
        raise ProtoflError(f"no LEAF .json file in {folder}")
    keep = None if labels is None else np.asarray(sorted(set(labels)), dtype=np.int64)
    out: UserData = {}
    for path in files:
        for user, x, y in _read_file(path):
            if keep is not None:
                mask = np.isin(y, keep)
                y = y[mask]
                x = x[mask] if isinstance(x, np.ndarray) else [v for v, m in zip(x, mask) if m]
            if user in out:
                ox, oy = out[user]
                x = np.concatenate([ox, x]) if isinstance(x, np.ndarray) else list(ox) + list(x)
                y = np.concatenate([oy, y])
            out[user] = (x, y)
    return out


def _read_file(path: Path) -> list[tuple[str, np.ndarray | list, np.ndarray]]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtoflError(f"LEAF file {path} is not readable JSON: "
                           f"{str(e).splitlines()[0]}") from None
    if not isinstance(doc, dict) or "users" not in doc or "user_data" not in doc:
        raise ProtoflError(f"LEAF file {path} lacks the 'users' and 'user_data' keys")
    users, data = doc["users"], doc["user_data"]
    counts = doc.get("num_samples")
    if not isinstance(users, list) or not isinstance(data, dict) or not (
            counts is None or isinstance(counts, list)):
        raise ProtoflError(f"LEAF file {path}: 'users' and 'num_samples' must be lists and "
                           "'user_data' an object")
    if counts is not None and len(counts) != len(users):
        raise ProtoflError(f"LEAF file {path}: {len(users)} users but {len(counts)} num_samples")
    rows = []
    for i, user in enumerate(users):
        d = data.get(user) if isinstance(user, (str, int)) else None
        if not isinstance(d, dict) or "x" not in d or "y" not in d:
            raise ProtoflError(f"LEAF file {path}: user {user!r} has no user_data x and y")
        x, y = d["x"], d["y"]
        if not isinstance(x, list) or not isinstance(y, list):
            raise ProtoflError(f"LEAF file {path}: user {user!r} has x or y that is not a list")
        if len(x) != len(y) or (counts is not None and counts[i] != len(y)):
            raise ProtoflError(f"LEAF file {path}: user {user!r} has {len(x)} x, {len(y)} y, "
                               f"num_samples {counts[i] if counts is not None else '-'}")
        try:
            ya = np.asarray(y, dtype=np.float64).reshape(-1)
            if len(ya) != len(y) or not np.all(np.isfinite(ya)) or not np.all(ya == np.round(ya)):
                raise ValueError("labels are not integers")
            if len(ya) and not (ya.min() >= 0 and ya.max() < 2**31):
                raise ValueError("labels must be integers in 0 .. 2^31 - 1")
            ya = ya.astype(np.int64)
            if not (x and isinstance(x[0], str)):
                with np.errstate(over="ignore"):  # beyond float32: inf, refused below
                    x = np.asarray(x, dtype=np.float32)
                if len(x) and x.ndim < 2:
                    raise ValueError("x must be a list of equal-size numeric samples")
                if not np.all(np.isfinite(x)):
                    raise ValueError("x holds values that are not finite (NaN or infinity)")
            elif not all(isinstance(v, str) for v in x):
                raise ValueError("x mixes file names and other values")
        except (ValueError, TypeError) as e:
            raise ProtoflError(f"LEAF file {path}: user {user!r} has malformed x or y "
                               f"({str(e).splitlines()[0]})") from None
        rows.append((str(user), x, ya))
    return rows


def write_leaf(folder: str | Path, users: list[str], xs: list, ys: list,
               name: str = "data.json") -> Path:
    """Write users' samples as one LEAF JSON file ``folder/name`` (folder created)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not len(users) == len(xs) == len(ys):
        raise ProtoflError("write_leaf: users, xs and ys must have the same length")
    doc = {"users": [str(u) for u in users],
           "num_samples": [len(y) for y in ys],
           "user_data": {str(u): {"x": np.asarray(x).tolist() if not isinstance(x, list) else x,
                                  "y": np.asarray(y).tolist()}
                         for u, x, y in zip(users, xs, ys)}}
    path = folder / name
    path.write_text(json.dumps(doc))
    return path


def leaf_layout(root: str | Path) -> tuple[Path, Path | None]:
    """(train folder, test folder or None) of a LEAF dataset: ``root`` or ``root/data`` with
    ``train/`` and ``test/``, else ``all_data/`` or the .json files of ``root`` itself."""
    root = Path(root)
    if root.is_file():
        raise ProtoflError(f"data.root {root} is a file; a LEAF data.root is a folder (of "
                           "train/ and test/, or all_data/, or .json files)")
    if not root.is_dir():
        raise ProtoflError(f"LEAF folder {root} does not exist")
    for base in (root, root / "data"):
        if (base / "train").is_dir():
            return base / "train", (base / "test") if (base / "test").is_dir() else None
        if (base / "all_data").is_dir():
            return base / "all_data", None
        if any(base.glob("*.json")):
            return base, None
    raise ProtoflError(f"no LEAF data in {root}: expected train/ and test/ folders of .json "
                       "files (or all_data/, or .json files)")


def load_leaf_split(root: str | Path, labels: Iterable[int] | None = None
                    ) -> tuple[UserData, UserData | None]:
    """(train users, test users or None) of a LEAF dataset folder."""
    labels = None if labels is None else list(labels)
    train_dir, test_dir = leaf_layout(root)
    train = read_leaf(train_dir, labels)
    return train, (read_leaf(test_dir, labels) if test_dir is not None else None)


def _concat(xs: list) -> np.ndarray | list | None:
    """The users' x joined (arrays stacked, file-name lists chained); None if all empty."""
    xs = [x for x in xs if len(x)]
    if not xs:
        return None
    if isinstance(xs[0], np.ndarray):
        return np.concatenate(xs)
    return [v for x in xs for v in x]


def federation_from_users(name: str, num_classes: int, users: list[str], train: UserData,
                          test: UserData | None, to_x: Callable[[np.ndarray | list], Source],
                          cfg: DataConfig, class_names: list[str] | None = None,
                          scale: float | None = None) -> FederatedData:
    """One client per user: with a test split, each user's own test samples are its local
    test set (their union the global one); without, a seeded 90/10 split per user.
    ``to_x`` turns all users' x, joined in user order, into a source of rows."""
    if not users:
        raise ProtoflError(f"{name}: no user with training samples")
    sizes = [len(train[u][1]) for u in users]
    y = torch.from_numpy(np.concatenate([train[u][1] for u in users])).long()
    x = to_x(_concat([train[u][0] for u in users]))
    if test is None:
        return from_ranges(name, num_classes, x, y, sizes, None, None,
                           cfg.local_test_fraction, cfg.seed, class_names, scale)
    empty = (np.zeros((0,), np.float32), np.zeros((0,), np.int64))
    tx = [test.get(u, empty) for u in users]
    te_y = torch.from_numpy(np.concatenate([t[1] for t in tx])).long()
    te_x = _concat([t[0] for t in tx])
    disk = to_disk(len(y) + len(te_y), x)
    x_train = gather(x, np.arange(len(y)), "x_train", disk)
    x_local = (gather(to_x(te_x), np.arange(len(te_y)), "x_local_test", disk)
               if te_x is not None else x_train[:0].clone())
    return FederatedData(
        name=name, num_classes=num_classes, x_train=x_train, y_train=y,
        train_offsets=np.concatenate([[0], np.cumsum(sizes)]),
        x_local_test=x_local, y_local_test=te_y,
        test_offsets=np.concatenate([[0], np.cumsum([len(t[1]) for t in tx])]),
        x_test=x_local, y_test=te_y, class_names=class_names or [], scale=scale)


def _pick_users(users: list[str], cfg: DataConfig) -> list[str]:
    if cfg.num_clients is not None:
        if cfg.num_clients > len(users):
            raise ProtoflError(f"data.num_clients = {cfg.num_clients} but the LEAF data in "
                               f"{cfg.root} has {len(users)} users with samples")
        users = users[:cfg.num_clients]
    return users


def _same_features(root, users: list[str], train: UserData, test: UserData | None) -> None:
    """Every sample of ``users`` (train and test) has the same feature shape."""
    first = None
    for split, data in (("train", train), ("test", test or {})):
        for u in users:
            if u in data and len(data[u][1]):
                x = data[u][0]
                if not isinstance(x, np.ndarray):
                    raise ProtoflError(f"LEAF data in {root}: {split} user {u!r} has non-numeric "
                                       "x; use the dataset that matches it (e.g. celeba)")
                shape = x.shape[1:]
                if first is None:
                    first = (split, u, shape)
                elif shape != first[2]:
                    raise ProtoflError(
                        f"LEAF data in {root}: {split} user {u!r} has {_n(shape)} features but "
                        f"{first[0]} user {first[1]!r} has {_n(first[2])}; every sample of "
                        "train and test must have the same size")


def _n(shape: tuple) -> str:
    return str(shape[0]) if len(shape) == 1 else "x".join(map(str, shape))


def leaf_federation(cfg: DataConfig) -> FederatedData:
    """Any LEAF folder of vector samples (e.g. the FedProx Synthetic files): a client per
    user (the first ``num_clients`` users if set); classes = 0..max label."""
    train, test = load_leaf_split(cfg.root)
    for u, (x, _) in train.items():
        if not isinstance(x, np.ndarray):
            raise ProtoflError(f"LEAF data in {cfg.root}: user {u!r} has non-numeric x; "
                               "use the dataset that matches it (e.g. celeba)")
    users = [u for u, (_, y) in train.items() if len(y)]
    if not users:
        raise ProtoflError(f"LEAF data in {cfg.root}: no user holds a training sample "
                           f"(all {len(train)} users have empty x and y)")
    users = _pick_users(users, cfg)
    _same_features(cfg.root, users, train, test)
    ys = [train[u][1] for u in users] + ([test[u][1] for u in users if u in test] if test
                                         else [])
    num_classes = int(max(int(y.max()) for y in ys if len(y))) + 1
    if num_classes > MAX_CLASSES:
        raise ProtoflError(f"LEAF data in {cfg.root}: a label of {num_classes - 1} implies "
                           f"{num_classes} classes (0 .. max label); at most {MAX_CLASSES} "
                           "are supported: number the classes 0, 1, 2, ...")
    return federation_from_users("leaf", num_classes, users, train, test,
                                 lambda x: np.asarray(x, np.float32), cfg)


def femnist_federation(cfg: DataConfig) -> FederatedData:
    """The seed's FEMNIST: letters 'a'-'j' only (LEAF labels 36-45 -> 0-9), the 200
    (``num_clients``) users with the most samples in their 5 most frequent of those classes,
    each keeping only those 5 classes; 28x28 images in (N, 1, 28, 28)."""
    labels = range(FEMNIST_FIRST, FEMNIST_FIRST + len(FEMNIST_LETTERS))
    train, test = load_leaf_split(cfg.root, labels)
    for split in (train, test or {}):
        for u, (x, y) in split.items():
            y -= FEMNIST_FIRST
            if len(y) and (not isinstance(x, np.ndarray) or x.shape[1:] != (784,)):
                raise ProtoflError(f"FEMNIST data in {cfg.root}: user {u!r} has x of shape "
                                   f"{np.shape(x)[1:]}, expected 784 pixels per sample")
    order = {u: i for i, u in enumerate(train)}
    k, m = cfg.num_clients or FEMNIST_CLIENTS, FEMNIST_CLASSES_PER_CLIENT
    chosen = []  # (score, order, user, kept classes)
    for u in train:
        y = np.concatenate([train[u][1], test[u][1] if test and u in test else []]).astype(int)
        counts = np.bincount(y, minlength=len(FEMNIST_LETTERS))
        if (counts > 0).sum() < m:
            continue
        top = np.argsort(-counts, kind="stable")[:m]
        chosen.append((-int(counts[top].sum()), order[u], u, np.sort(top)))
    if not chosen:
        raise ProtoflError(f"FEMNIST in {cfg.root}: none of its {len(train)} users holds "
                           f"samples of {m} of the letters a-j (LEAF labels {FEMNIST_FIRST}-"
                           f"{FEMNIST_FIRST + len(FEMNIST_LETTERS) - 1}); is it FEMNIST's "
                           "by-writer LEAF data?")
    if len(chosen) < k:
        asked = "" if cfg.num_clients else f", the default {FEMNIST_CLIENTS}"
        raise ProtoflError(f"FEMNIST in {cfg.root}: only {len(chosen)} users hold {m} of the "
                           f"letters a-j, {k} clients asked (data.num_clients{asked}); set "
                           f"data.num_clients to at most {len(chosen)}")
    chosen = sorted(chosen)[:k]
    chosen.sort(key=lambda t: t[1])  # clients in file order
    users = [u for _, _, u, _ in chosen]

    def restrict(split: UserData) -> UserData:
        out = {}
        for _, _, u, top in chosen:
            if u in split:
                x, y = split[u]
                mask = np.isin(y, top)
                out[u] = (x[mask], y[mask])
        return out

    return federation_from_users(
        "femnist", len(FEMNIST_LETTERS), users, restrict(train),
        restrict(test) if test is not None else None,
        lambda x: np.asarray(x, np.float32).reshape(-1, 1, 28, 28), cfg,
        class_names=list(FEMNIST_LETTERS))


def celeba_image_folder(root: Path) -> Path:
    """Where LEAF keeps the CelebA images: ``raw/img_align_celeba`` (or ``img_align_celeba``)
    under the root or its ``data/`` folder."""
    for c in (root / "raw" / "img_align_celeba", root / "img_align_celeba",
              root / "data" / "raw" / "img_align_celeba", root.parent / "raw" / "img_align_celeba"):
        if c.is_dir():
            return c
    raise ProtoflError(f"CelebA images not found: expected {root / 'raw' / 'img_align_celeba'} "
                       f"or {root / 'img_align_celeba'}")


def celeba_federation(cfg: DataConfig) -> FederatedData:
    """LEAF's CelebA: x = image file names, y = smiling (1) or not (0); a client per
    celebrity (the first ``num_clients`` if set; whole celebrities up to ``max_samples``
    training images if set); RGB images resized to ``image_size`` (default 84, as LEAF)."""
    root = Path(cfg.root)
    train, test = load_leaf_split(root)
    folder = celeba_image_folder(root)
    users = _pick_users([u for u, (_, y) in train.items() if len(y)], cfg)
    if cfg.max_samples is not None:
        total, kept = 0, []
        for u in users:
            total += len(train[u][1])
            if kept and total > cfg.max_samples:
                break
            kept.append(u)
        users = kept
    for split in (train, test or {}):
        for u in users:
            if u in split and isinstance(split[u][0], np.ndarray) and len(split[u][0]):
                raise ProtoflError(f"CelebA data in {root}: user {u!r} has numeric x; "
                                   "expected image file names")
            if u in split and len(split[u][1]) and split[u][1].max() > 1:
                raise ProtoflError(f"CelebA data in {root}: user {u!r} has labels other than "
                                   "0/1 (smiling)")
    size = cfg.image_size or CELEBA_SIZE
    return federation_from_users(
        "celeba", 2, users, train, test,
        lambda names: ImageRows([folder / n for n in names], size, "RGB"), cfg,
        class_names=["not smiling", "smiling"], scale=PIXEL_MAX)
