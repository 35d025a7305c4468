"""Damaged data files (truncated, bit-flipped, garbage, wrong shapes, NaN) thrown at every file
loader: each answer is a dataset or one ProtoflError line, never another exception."""

import csv
import gzip
import json
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from protofl.config import DataConfig
from protofl.data.registry import load_dataset
from protofl.errors import ProtoflError

FUZZ = settings(max_examples=30, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])

# A damage: ("truncate", where), ("flip", where, bit), ("garbage", bytes), ("empty",)
damages = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("flip"), st.floats(0, 1), st.integers(0, 7)),
    st.tuples(st.just("garbage"), st.binary(max_size=40)),
    st.tuples(st.just("empty")),
)


def damage(path: Path, how: tuple) -> None:
    data = bytearray(path.read_bytes())
    if how[0] == "truncate":
        data = data[: int(how[1] * len(data))]
    elif how[0] == "flip" and data:
        i = min(int(how[1] * len(data)), len(data) - 1)
        data[i] ^= 1 << how[2]
    elif how[0] == "garbage":
        data = bytearray(how[1])
    elif how[0] == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))


def outcome(load: Callable[[], object]) -> str:
    """'ok' with finite features, or 'refused' with a one-line ProtoflError."""
    try:
        data = load()
    except ProtoflError as e:
        assert str(e) and "\n" not in str(e), repr(str(e))
        return "refused"
    for x in (data.x_train, data.x_test):
        assert torch.isfinite(x).all()
    return "ok"


# ---- MNIST IDX ----
MNIST = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
         "t10k-labels-idx1-ubyte")


def write_mnist(root: Path, gz: bool) -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (40, 28, 28)), np.arange(40) % 10,
              rng.integers(0, 256, (10, 28, 28)), np.arange(10) % 10]
    for name, a in zip(MNIST, arrays):
        raw = struct.pack(">HBB", 0, 8, a.ndim) + struct.pack(f">{a.ndim}I", *a.shape)
        raw += a.astype(np.uint8).tobytes()
        (root / (name + (".gz" if gz else ""))).write_bytes(gzip.compress(raw) if gz else raw)


@FUZZ
@given(st.sampled_from(MNIST), st.booleans(), damages)
def test_mnist_idx_damaged(name, gz, how):
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        write_mnist(root, gz)
        damage(root / (name + (".gz" if gz else "")), how)
        outcome(lambda: load_dataset(DataConfig(name="mnist", root=d, num_clients=2)))


# ---- LEAF JSON ----
def leaf_doc(n_users=3, dim=5, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    users = [f"u{k}" for k in range(n_users)]
    data = {u: {"x": rng.normal(size=(4, dim)).round(3).tolist(), "y": [0, 1, 2, 1]}
            for u in users}
    return {"users": users, "num_samples": [4] * n_users, "user_data": data}


def write_leaf_split(root: Path, train: dict, test: dict) -> None:
    for split, doc in (("train", train), ("test", test)):
        (root / split).mkdir(parents=True, exist_ok=True)
        (root / split / "d.json").write_text(json.dumps(doc))


@FUZZ
@given(st.sampled_from(["train", "test"]), damages)
def test_leaf_json_damaged(split, how):
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        write_leaf_split(root, leaf_doc(), leaf_doc(seed=1))
        damage(root / split / "d.json", how)
        outcome(lambda: load_dataset(DataConfig(name="leaf", root=d)))


# semantic damage to one user's x or y: NaN, infinities, wrong shapes, wrong types
values = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5),
                   st.text(max_size=3), st.none())
x_damage = st.one_of(
    st.tuples(st.just("cell"), st.integers(0, 3), st.integers(0, 4), values),
    st.tuples(st.just("row"), st.integers(0, 3), st.lists(values, max_size=7)),
    st.tuples(st.just("x"), st.lists(st.lists(st.floats(-3, 3), max_size=6), max_size=4)),
    st.tuples(st.just("y"), st.integers(0, 3), values),
)


@FUZZ
@given(st.sampled_from(["train", "test"]), x_damage)
def test_leaf_json_bad_values(split, how):
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        docs = {"train": leaf_doc(), "test": leaf_doc(seed=1)}
        user = docs[split]["user_data"]["u1"]
        if how[0] == "cell":
            user["x"][how[1]][how[2]] = how[3]
        elif how[0] == "row":
            user["x"][how[1]] = how[2]
        elif how[0] == "x":
            user["x"] = how[1]
        else:
            user["y"][how[1]] = how[2]
        write_leaf_split(root, docs["train"], docs["test"])
        outcome(lambda: load_dataset(DataConfig(name="leaf", root=d)))


def test_leaf_train_and_test_feature_sizes_must_agree(tmp_path):
    write_leaf_split(tmp_path, leaf_doc(dim=5), leaf_doc(dim=6))
    with pytest.raises(ProtoflError, match="6 features.*5"):
        load_dataset(DataConfig(name="leaf", root=str(tmp_path)))


def test_leaf_nan_features_are_refused(tmp_path):
    train = leaf_doc()
    train["user_data"]["u2"]["x"][1][3] = float("nan")
    write_leaf_split(tmp_path, train, leaf_doc(seed=1))
    with pytest.raises(ProtoflError, match="u2.*not finite"):
        load_dataset(DataConfig(name="leaf", root=str(tmp_path)))


# ---- medical: MedMNIST npz, HAM10000 CSV + JPEG, Matek-19 TIFF ----
def write_medmnist(path: Path, **change) -> None:
    rng = np.random.default_rng(2)
    arrays = {}
    for split, n in (("train", 24), ("val", 3), ("test", 8)):
        arrays[f"{split}_images"] = rng.integers(0, 256, (n, 8, 8)).astype(np.uint8)
        arrays[f"{split}_labels"] = (np.arange(n) % 3)[:, None].astype(np.uint8)
    arrays.update(change)
    np.savez(path, **arrays)


@FUZZ
@given(damages)
def test_medmnist_npz_damaged(how):
    with tempfile.TemporaryDirectory() as d:
        write_medmnist(Path(d) / "blood.npz")
        damage(Path(d) / "blood.npz", how)
        outcome(lambda: load_dataset(DataConfig(name="medmnist", root=d, num_clients=2)))


arrays_bad = st.sampled_from([
    ("test_images", np.zeros((8, 9, 9), np.uint8)),        # another image size than train
    ("train_images", np.full((24, 8, 8), np.nan)),          # float with NaN
    ("train_images", np.zeros((24, 8, 8, 2), np.uint8)),    # two channels
    ("train_images", np.zeros((24,), np.uint8)),            # no pixels
    ("train_labels", np.full((24, 1), -1, np.int64)),       # negative labels
    ("train_labels", np.full((24, 1), np.nan)),             # NaN labels
    ("test_labels", np.zeros((0, 1), np.uint8)),            # empty test labels
    ("train_labels", np.zeros((24, 1), np.uint8)),          # one class only: fine
    ("train_images", np.zeros((0, 8, 8), np.uint8)),        # empty train set
])


@settings(max_examples=9, deadline=None, derandomize=True)
@given(arrays_bad)
def test_medmnist_npz_bad_arrays(change):
    with tempfile.TemporaryDirectory() as d:
        key, arr = change
        extra = {"train_labels": np.zeros((0, 1), np.uint8)} if key == "train_images" and (
            len(arr) == 0) else {}
        write_medmnist(Path(d) / "blood.npz", **{key: arr}, **extra)
        outcome(lambda: load_dataset(DataConfig(name="medmnist", root=d, num_clients=2)))


def write_ham(root: Path) -> list[Path]:
    rng = np.random.default_rng(0)
    rows = [{"lesion_id": f"HAM_{i // 2:07d}", "image_id": f"ISIC_{i:07d}",
             "dx": ("nv", "mel", "bkl")[i % 3]} for i in range(12)]
    (root / "imgs").mkdir()
    paths = []
    for r in rows:
        p = root / "imgs" / f"{r['image_id']}.jpg"
        Image.fromarray(rng.integers(0, 256, (6, 6, 3)).astype(np.uint8)).save(p)
        paths.append(p)
    with open(root / "HAM10000_metadata.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return paths


@FUZZ
@given(st.integers(-1, 11), damages)
def test_ham10000_damaged(which, how):
    with tempfile.TemporaryDirectory() as d:
        paths = write_ham(Path(d))
        damage(paths[which] if which >= 0 else Path(d) / "HAM10000_metadata.csv", how)
        outcome(lambda: load_dataset(DataConfig(name="ham10000", root=d, num_clients=2,
                                                image_size=6, partition="iid")))


@FUZZ
@given(st.integers(0, 5), damages)
def test_matek19_damaged(which, how):
    with tempfile.TemporaryDirectory() as d:
        rng = np.random.default_rng(1)
        paths = []
        for c in ("BAS", "EOS"):
            (Path(d) / c).mkdir()
            for i in range(3):
                p = Path(d) / c / f"{c}_{i}.tiff"
                Image.fromarray(rng.integers(0, 256, (6, 6, 3)).astype(np.uint8)).save(p)
                paths.append(p)
        damage(paths[which], how)
        outcome(lambda: load_dataset(DataConfig(name="matek19", root=d, num_clients=2,
                                                image_size=6, partition="iid")))


# ---- Pascal VOC ----
def write_voc(root: Path) -> dict[str, Path]:
    base = root / "VOC2012"
    for sub in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (base / sub).mkdir(parents=True)
    rng = np.random.default_rng(0)
    ids = {"train": [f"t{i}" for i in range(8)], "val": [f"v{i}" for i in range(3)]}
    files = {}
    for split, names in ids.items():
        for i, name in enumerate(names):
            mask = np.zeros((6, 8), np.uint8)
            mask[1:4, 1:5] = 1 + i % 3
            mask[0] = 255
            m = Image.fromarray(mask, mode="P")
            m.putpalette([0, 0, 0] * 256)
            m.save(base / "SegmentationClass" / f"{name}.png")
            Image.fromarray(rng.integers(0, 256, (6, 8, 3)).astype(np.uint8)).save(
                base / "JPEGImages" / f"{name}.jpg")
            files[f"{name}.png"] = base / "SegmentationClass" / f"{name}.png"
            files[f"{name}.jpg"] = base / "JPEGImages" / f"{name}.jpg"
        lst = base / "ImageSets" / "Segmentation" / f"{split}.txt"
        lst.write_text("\n".join(names) + "\n")
        files[f"{split}.txt"] = lst
    return files


VOC_FILES = ["t0.png", "t3.png", "v1.png", "t0.jpg", "v2.jpg", "train.txt", "val.txt"]


@FUZZ
@given(st.sampled_from(VOC_FILES), damages)
def test_voc_damaged(name, how):
    with tempfile.TemporaryDirectory() as d:
        files = write_voc(Path(d))
        damage(files[name], how)
        outcome(lambda: load_dataset(DataConfig(name="voc", root=d, num_clients=2,
                                                image_size=6, partition="iid")))


def test_leaf_feature_size_mismatch_is_exit_2_on_the_cli(tmp_path, capsys):
    from protofl.cli import main

    write_leaf_split(tmp_path, leaf_doc(dim=5), leaf_doc(dim=6))
    assert main(["run", "--dataset", "leaf", "--set", f"data.root={tmp_path}",
                 "--rounds", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "6 features" in err and "\n" not in err
