"""HAM10000, Matek-19 and MedMNIST loaders on tiny files in the real layouts."""

import csv

import numpy as np
import pytest
import torch
from PIL import Image

from protofl.config import DataConfig
from protofl.data.images import read_image
from protofl.data.medical import (
    HAM_CLASSES,
    MATEK_CLASSES,
    group_split,
    ham10000_federation,
    matek19_federation,
    medmnist_federation,
)
from protofl.errors import ProtoflError


def write_ham(root, n_lesions=20, seed=0):
    """Metadata CSV + JPEGs split over the two official folders; lesions have 1-3 images."""
    rng = np.random.default_rng(seed)
    rows, n = [], 0
    for les in range(n_lesions):
        dx = HAM_CLASSES[les % 7]
        for _ in range(1 + les % 3):
            rows.append({"lesion_id": f"HAM_{les:07d}", "image_id": f"ISIC_{n:07d}", "dx": dx,
                         "dx_type": "histo", "age": "50.0", "sex": "male",
                         "localization": "back"})
            n += 1
    for part in (1, 2):
        (root / f"HAM10000_images_part_{part}").mkdir(parents=True)
    for i, r in enumerate(rows):
        folder = root / f"HAM10000_images_part_{1 + i % 2}"
        a = rng.integers(0, 256, (9, 12, 3)).astype(np.uint8)
        Image.fromarray(a).save(folder / f"{r['image_id']}.jpg")
    with open(root / "HAM10000_metadata.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return rows


def test_group_split_keeps_groups_whole():
    groups = np.repeat(np.arange(30), np.arange(30) % 4 + 1)
    mask = group_split(groups, 0.2, seed=3)
    assert set(groups[mask]).isdisjoint(groups[~mask])
    assert 0 < mask.sum() <= 0.2 * len(groups)


def test_ham10000_lesion_split_and_shapes(tmp_path):
    rows = write_ham(tmp_path)
    cfg = DataConfig(name="ham10000", root=str(tmp_path), num_clients=3, image_size=8,
                     partition="iid")
    data = ham10000_federation(cfg)
    assert data.num_classes == 7 and data.class_names == list(HAM_CLASSES)
    assert data.input_shape == (3, 8, 8)
    assert len(data.x_test) + data.train_sizes.sum() + len(data.x_local_test) == len(rows)
    assert 0 < len(data.x_test) <= 0.2 * len(rows)
    # map every loaded image back to its row, through the pixels
    refs = np.stack([read_image(next(tmp_path.rglob(r["image_id"] + ".jpg")), 8)
                     for r in rows]).reshape(len(rows), -1)

    def lesions(x, y):
        out = set()
        assert x.dtype == torch.uint8
        x = data.inputs(x)
        for xi, yi in zip(x.reshape(len(x), -1).numpy(), y.tolist()):
            j = int(np.argmin(np.abs(refs - xi).sum(1)))
            assert np.allclose(refs[j], xi) and HAM_CLASSES.index(rows[j]["dx"]) == yi
            out.add(rows[j]["lesion_id"])
        return out

    test_lesions = lesions(data.x_test, data.y_test)
    train_lesions = lesions(data.x_train, data.y_train) | lesions(data.x_local_test,
                                                                  data.y_local_test)
    assert test_lesions and train_lesions and test_lesions.isdisjoint(train_lesions)


def test_ham10000_tab_metadata_with_bom(tmp_path):
    """The Dataverse copy: tab-separated HAM10000_metadata.tab, here with a UTF-8 BOM."""
    rows = write_ham(tmp_path, n_lesions=8)
    csv_path = tmp_path / "HAM10000_metadata.csv"
    text = csv_path.read_text().replace(",", "\t")
    (tmp_path / "HAM10000_metadata.tab").write_text("\ufeff" + text, encoding="utf-8")
    csv_path.unlink()
    data = ham10000_federation(DataConfig(name="ham10000", root=str(tmp_path), num_clients=2,
                                          image_size=8, partition="iid"))
    assert len(data.x_test) + data.train_sizes.sum() + len(data.x_local_test) == len(rows)
    assert sorted(set(data.y_test.tolist() + data.y_train.tolist() + data.y_local_test.tolist())
                  ) == sorted({HAM_CLASSES.index(r["dx"]) for r in rows})


def test_ham10000_bad_inputs(tmp_path):
    rows = write_ham(tmp_path)
    cfg = DataConfig(name="ham10000", root=str(tmp_path), num_clients=2, image_size=8)
    bad = next(tmp_path.rglob(rows[4]["image_id"] + ".jpg"))
    bad.write_bytes(b"\xff\xd8 truncated")
    with pytest.raises(ProtoflError, match=rows[4]["image_id"]):
        ham10000_federation(cfg)
    bad.unlink()
    with pytest.raises(ProtoflError, match=rows[4]["image_id"]):
        ham10000_federation(cfg)
    meta = tmp_path / "HAM10000_metadata.csv"
    text = meta.read_text()
    meta.write_text(text.replace("lesion_id", "lesion"))
    with pytest.raises(ProtoflError, match="HAM10000_metadata.csv.*lesion_id"):
        ham10000_federation(cfg)
    meta.write_text(text.replace(",nv,", ",naevus,", 1))
    with pytest.raises(ProtoflError, match="naevus"):
        ham10000_federation(cfg)


def write_matek(root, per_class=4, classes=("BAS", "EOS", "LYT")):
    rng = np.random.default_rng(1)
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            a = rng.integers(0, 256, (10, 10, 3)).astype(np.uint8)
            Image.fromarray(a).convert("RGBA").save(root / c / f"{c}_{i:04d}.tiff")


def test_matek19(tmp_path):
    base = tmp_path / "AML-Cytomorphology_LMU"
    write_matek(base)
    data = matek19_federation(DataConfig(name="matek19", root=str(tmp_path), num_clients=2,
                                         image_size=8, partition="iid"))
    assert data.num_classes == 15 and data.input_shape == (3, 8, 8)
    assert sorted(set(data.y_test.tolist())) == [MATEK_CLASSES.index(c)
                                                 for c in ("BAS", "EOS", "LYT")]
    assert len(data.y_test) == 3  # round(0.2 * 4) = 1 per class
    (base / "XYZ").mkdir()
    with pytest.raises(ProtoflError, match="XYZ.*BAS, EBO"):
        matek19_federation(DataConfig(name="matek19", root=str(base), num_clients=2))
    (base / "XYZ").rmdir()
    (base / "MON").mkdir()
    with pytest.raises(ProtoflError, match="MON"):
        matek19_federation(DataConfig(name="matek19", root=str(base), num_clients=2))
    (base / "MON" / "MON_0001.tiff").write_bytes(b"II*\x00garbage")
    with pytest.raises(ProtoflError, match="MON_0001.tiff"):
        matek19_federation(DataConfig(name="matek19", root=str(base), num_clients=2))


@pytest.mark.parametrize("rgb", [False, True])
def test_medmnist(tmp_path, rgb):
    rng = np.random.default_rng(2)
    shape = (28, 28, 3) if rgb else (28, 28)
    arrays = {}
    for split, n in (("train", 40), ("val", 5), ("test", 12)):
        arrays[f"{split}_images"] = rng.integers(0, 256, (n, *shape)).astype(np.uint8)
        arrays[f"{split}_labels"] = (np.arange(n) % 4)[:, None].astype(np.uint8)
    np.savez(tmp_path / "dermamnist.npz", **arrays)
    data = medmnist_federation(DataConfig(name="medmnist", root=str(tmp_path), num_clients=3,
                                          partition="iid"))
    c = 3 if rgb else 1
    assert data.num_classes == 4 and data.input_shape == (c, 28, 28)
    want = arrays["test_images"].astype(np.float32) / 255.0
    want = want.transpose(0, 3, 1, 2) if rgb else want[:, None]
    assert data.x_test.dtype == torch.uint8
    assert torch.equal(data.inputs(data.x_test), torch.from_numpy(want))  # the float path's
    assert data.train_sizes.sum() + len(data.x_local_test) == 40
    small = medmnist_federation(DataConfig(name="medmnist", root=str(tmp_path / "dermamnist.npz"),
                                           num_clients=3, image_size=16, max_samples=20))
    assert small.input_shape == (c, 16, 16)
    assert small.train_sizes.sum() + len(small.x_local_test) == 20
    del arrays["test_labels"]
    np.savez(tmp_path / "dermamnist.npz", **arrays)
    with pytest.raises(ProtoflError, match="dermamnist.npz.*test_labels"):
        medmnist_federation(DataConfig(name="medmnist", root=str(tmp_path), num_clients=3))
