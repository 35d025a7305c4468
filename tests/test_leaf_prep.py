"""LEAF JSON from raw SD19 (FEMNIST) and CelebA files, on tiny trees in the real layouts."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from protofl.config import DataConfig
from protofl.data.leaf import femnist_federation, read_leaf
from protofl.data.leaf_prep import (
    celeba_prepare,
    celeba_to_leaf,
    femnist_label,
    femnist_pixels,
    femnist_prepare,
)
from protofl.errors import ProtoflError


def test_femnist_labels_follow_leaf_numbering():
    # hand-worked: '0'=0x30 -> 0, 'A'=0x41 -> 10, 'Z'=0x5a -> 35, 'a'=0x61 -> 36, 'z' -> 61
    assert [femnist_label(h) for h in ("30", "39", "41", "5a", "61", "6a", "7a")] == [
        0, 9, 10, 35, 36, 45, 61]
    with pytest.raises(ProtoflError, match="hex code"):
        femnist_label("2f")


def test_femnist_pixels_are_28x28_in_unit_range(tmp_path):
    p = tmp_path / "g.png"
    Image.fromarray(np.full((128, 128), 51, np.uint8)).save(p)  # 51 / 255 = 0.2
    v = femnist_pixels(p)
    assert len(v) == 784 and np.allclose(v, 0.2)


def write_sd19(raw, writers=3, letters="abcdef", per_letter=2):
    """by_class/<hex>/hsf_0/*.png and by_write/hsf_0/<writer>/l<writer>/*.png holding the same
    bytes (distinct images), plus a train_<hex> copy and a .mit file LEAF ignores."""
    rng = np.random.default_rng(0)
    truth = {}
    n = 0
    for w in range(writers):
        wdir = raw / "by_write" / "hsf_0" / f"f{w:04d}_14" / f"l{w:04d}_14"
        wdir.mkdir(parents=True)
        for ch in letters[w % 2:]:  # writers hold different letter sets
            code = f"{ord(ch):x}"
            cdir = raw / "by_class" / code / "hsf_0"
            cdir.mkdir(parents=True, exist_ok=True)
            (raw / "by_class" / code / "hsf_0.mit").write_text("index\n")
            for _ in range(per_letter):
                a = rng.integers(0, 256, (128, 128), dtype=np.uint8)
                Image.fromarray(a).save(cdir / f"hsf_0_{n:05d}.png")
                (wdir / f"l{w:04d}_14_{n:05d}.png").write_bytes(
                    (cdir / f"hsf_0_{n:05d}.png").read_bytes())
                truth.setdefault(f"f{w:04d}_14", []).append(36 + "abcdefghij".index(ch))
                n += 1
    return truth


def test_femnist_prepare_writes_leaf_json_the_loader_reads(tmp_path):
    truth = write_sd19(tmp_path / "raw")
    femnist_prepare(tmp_path)
    assert not (tmp_path / "raw").exists()
    users = read_leaf(tmp_path / "all_data")
    assert set(users) == set(truth)
    for u, (x, y) in users.items():
        assert sorted(y.tolist()) == sorted(truth[u]) and x.shape == (len(y), 784)
    fed = femnist_federation(DataConfig(name="femnist", root=str(tmp_path), num_clients=3))
    assert fed.num_clients == 3 and fed.input_shape == (1, 28, 28)


def test_femnist_prepare_without_matches_fails(tmp_path):
    write_sd19(tmp_path / "raw", writers=1)
    for p in (tmp_path / "raw" / "by_class").rglob("*.png"):
        p.write_bytes(b"other")
    with pytest.raises(ProtoflError, match="no image of .* was found"):
        femnist_prepare(tmp_path)


def write_celeba(raw, celebs=(7, 3, 5)):
    (raw / "img_align_celeba").mkdir(parents=True)
    ids, attrs, n = [], [], 0
    for c, k in enumerate(celebs):
        for _ in range(k):
            name = f"{n:06d}.jpg"
            ids.append(f"{name} {100 + c}")
            attrs.append(f"{name} " + " ".join(["1" if n % 3 == 0 else "-1", "-1"]))
            n += 1
    (raw / "identity_CelebA.txt").write_text("\n".join(ids) + "\n")
    (raw / "list_attr_celeba.txt").write_text(f"{n}\nSmiling Young\n" + "\n".join(attrs))


def test_celeba_to_leaf_hand_worked(tmp_path):
    write_celeba(tmp_path / "raw")
    doc = celeba_to_leaf(tmp_path / "raw" / "identity_CelebA.txt",
                         tmp_path / "raw" / "list_attr_celeba.txt")
    # celebrity 101 has 3 < 5 images: dropped; images 0..6 are 100's, 10..14 are 102's
    assert doc["users"] == ["100", "102"] and doc["num_samples"] == [7, 5]
    assert doc["user_data"]["100"]["y"] == [1, 0, 0, 1, 0, 0, 1]  # smiling when n % 3 == 0
    assert doc["user_data"]["102"]["x"][0] == "000010.jpg"
    assert doc["user_data"]["102"]["y"] == [0, 0, 1, 0, 0]


def test_celeba_prepare_writes_all_data_and_names_missing_files(tmp_path):
    with pytest.raises(ProtoflError, match="missing .*identity_CelebA.txt"):
        celeba_prepare(tmp_path)
    write_celeba(tmp_path / "raw")
    celeba_prepare(tmp_path)
    doc = json.loads((tmp_path / "all_data" / "all_data.json").read_text())
    assert doc["users"] == ["100", "102"]
    assert not list((tmp_path / "all_data").glob("*.tmp"))
