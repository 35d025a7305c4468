"""The Hugging Face source (flwr-datasets) on small datasets the tests save to disk."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from protofl.config import DataConfig, config_from_dict
from protofl.data.registry import load_dataset
from protofl.data.site import site_data
from protofl.errors import ProtoflError

datasets = pytest.importorskip("datasets")
pytest.importorskip("flwr_datasets")
from protofl.data.hf import HFOptions, hf_federation, natural_id_parts  # noqa: E402

CENTERS = ("c0", "c1", "c2")


def images(values, size=6, mode="RGB"):
    from PIL import Image

    shape = (size, size, 3) if mode == "RGB" else (size, size)
    return [Image.fromarray(np.full(shape, v, np.uint8), mode) for v in values]


def save(tmp_path, n_train=30, n_test=9, labels="classlabel", mode="RGB"):
    """A DatasetDict whose image i is filled with the value i (so rows can be traced), a
    label column ('label' for plain integers, else 'target') and a natural 'center' column."""
    lab = "label" if labels == "int" else "target"
    def split(n, offset):
        y = [(i * 7) % 3 for i in range(n)]
        col = {"classlabel": y, "int": y, "str": [["cat", "dog", "eel"][v] for v in y]}[labels]
        return {"img": images(range(offset, offset + n), mode=mode), lab: col,
                "center": [CENTERS[i % 3] if i % 5 else "c0" for i in range(n)]}

    feats = {"img": datasets.Image(),
             lab: (datasets.ClassLabel(names=["cat", "dog", "eel"]) if labels == "classlabel"
                        else datasets.Value("int64" if labels == "int" else "string")),
             "center": datasets.Value("string")}
    d = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict(split(n_train, 0), features=datasets.Features(feats)),
        "test": datasets.Dataset.from_dict(split(n_test, 100), features=datasets.Features(feats))})
    d.save_to_disk(str(tmp_path / "ds"))
    return str(tmp_path / "ds")


def row_ids(x: torch.Tensor) -> list[int]:
    return [int(round(v * 255)) for v in x[:, 0, 0, 0].tolist()]


def test_natural_id_partition_gives_one_client_per_center(tmp_path):
    path = save(tmp_path)
    cfg = DataConfig(name="hf", local_test_fraction=0.2, seed=3)
    fed = hf_federation(HFOptions(path, partition_by="center"), cfg)
    assert fed.num_clients == 3 and fed.num_classes == 3
    assert fed.class_names == ["cat", "dog", "eel"]
    assert fed.x_train.dtype == torch.float32 and fed.input_shape == (3, 6, 6)
    centers = [CENTERS[i % 3] if i % 5 else "c0" for i in range(30)]
    for k, c in enumerate(CENTERS):  # the partitioner sorts natural ids
        rows = sorted(row_ids(fed.client_train(k)[0]) + row_ids(fed.client_test(k)[0]))
        assert rows == [i for i in range(30) if centers[i] == c]
        x, y = fed.client_train(k)
        assert y.tolist() == [(r * 7) % 3 for r in row_ids(x)]  # labels follow their images
    assert row_ids(fed.x_test) == list(range(100, 109)) and len(fed.y_test) == 9


def test_natural_id_parts_match_the_column(tmp_path):
    ds = datasets.load_from_disk(save(tmp_path))["train"]
    parts = natural_id_parts(ds, "center")
    assert [sorted(p.tolist()) for p in parts] == [
        [i for i in range(30) if (CENTERS[i % 3] if i % 5 else "c0") == c] for c in CENTERS]
    assert len(natural_id_parts(ds, "center", 2)) == 2
    with pytest.raises(ProtoflError, match="only 3 distinct values"):
        natural_id_parts(ds, "center", 4)
    with pytest.raises(ProtoflError, match="no column 'site'"):
        natural_id_parts(ds, "site")


def test_protofl_partitioner_via_the_registry(tmp_path):
    path = save(tmp_path, labels="int")
    fed = load_dataset(DataConfig(name="hf", root=path, partition="iid", num_clients=4,
                                  image_size=4, local_test_fraction=0.0))
    assert fed.num_clients == 4 and fed.input_shape == (3, 4, 4)
    assert sorted(fed.train_sizes.tolist()) == [7, 7, 8, 8]
    assert fed.class_names == ["0", "1", "2"]


def test_string_labels_grey_images_and_no_test_split(tmp_path):
    path = save(tmp_path, labels="str", mode="L")
    fed = hf_federation(HFOptions(path, test_split=None, image_column="img",
                                  label_column="target"),
                        DataConfig(name="hf", num_clients=2, alpha=100.0))
    assert fed.class_names == ["cat", "dog", "eel"] and fed.input_shape == (1, 6, 6)
    assert len(fed.x_test) == len(fed.x_local_test)  # the union of the local tests


def test_bad_options_are_one_clear_error(tmp_path):
    path = save(tmp_path)
    cfg = DataConfig(name="hf")
    with pytest.raises(ProtoflError, match="no label column 'y'; columns: img, target"):
        hf_federation(HFOptions(path, label_column="y"), cfg)
    with pytest.raises(ProtoflError, match="no split 'training'; splits: train, test"):
        hf_federation(HFOptions(path, train_split="training"), cfg)
    with pytest.raises(ProtoflError, match="cannot be loaded"):
        hf_federation(HFOptions(str(tmp_path / "missing")), cfg)
    with pytest.raises(ProtoflError, match="needs a dataset"):
        load_dataset(DataConfig(name="hf"))


def test_hf_config_keys_reach_the_loader(tmp_path):
    """The data.hf_* keys: hf_dataset wins over data.root, the natural-id column and the
    columns are options of the config."""
    path = save(tmp_path, labels="str", mode="L")
    fed = load_dataset(DataConfig(name="hf", root=str(tmp_path / "elsewhere"), hf_dataset=path,
                                  hf_partition_by="center", hf_image_column="img",
                                  hf_label_column="target", hf_test_split=None,
                                  hf_image_mode="RGB"))
    assert fed.num_clients == 3 and fed.input_shape == (3, 6, 6)
    assert len(fed.x_test) == len(fed.x_local_test)  # no test split: the local tests
    with pytest.raises(ProtoflError, match="data.hf_image_mode = 'CMYK' is out of range"):
        config_from_dict({"data": {"hf_image_mode": "CMYK"}})


def test_hf_site_holds_out_its_test_split_or_a_fraction(tmp_path):
    """A site whose files are a Hugging Face dataset: its test split is held out; without
    one, data.local_test_fraction of its samples; ClassLabel names map to the agreed order."""
    path = save(tmp_path)
    cfg = DataConfig(name="site", num_clients=2, classes=["eel", "dog", "cat"],
                     input_shape=[3, 6, 6], local_test_fraction=0.2, hf_partition_by="center")
    fed = site_data(cfg, "hf", path, 1)
    assert fed.train_sizes.tolist() == [0, 30] and len(fed.client_test(1)[1]) == 9
    x, y = fed.client_train(1)
    assert y.tolist() == [2 - (r * 7) % 3 for r in row_ids(x)]  # cat is 0 there, 2 here
    fed = site_data(dataclasses.replace(cfg, hf_test_split=None), "hf", path, 0)
    assert fed.train_sizes.tolist() == [24, 0] and len(fed.client_test(0)[1]) == 6
