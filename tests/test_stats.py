"""Partition statistics: the figures, and stats.json in every run folder for every kind of
dataset (built in, and file-based ones on tiny trees in their real layouts)."""

import json

import numpy as np
import pytest
import torch
from test_loaders_medical import write_ham, write_matek
from test_loaders_mnist import write_mnist
from test_loaders_voc import write_voc
from test_loaders_voc_seg import write_voc as write_voc_seg

from protofl.config import DataConfig
from protofl.data.federated import FederatedData
from protofl.data.registry import load_dataset
from protofl.report.stats import partition_summary, write_stats


def test_summary_counts_by_hand():
    # client 0: classes {0, 1} (3 samples), client 1: class {2} (1 sample), client 2: {0, 2}
    y = torch.tensor([0, 1, 1, 2, 0, 2])
    x = torch.zeros(6, 2)
    data = FederatedData(name="toy", num_classes=3, x_train=x, y_train=y,
                         train_offsets=np.array([0, 3, 4, 6]), x_local_test=x[:0],
                         y_local_test=y[:0], test_offsets=np.array([0, 0, 0, 0]),
                         x_test=x[:2], y_test=y[:2])
    s = partition_summary(data)
    assert s["clients"] == 3 and s["train_samples"] == 6 and s["global_test_samples"] == 2
    assert s["samples_per_client"]["min"] == 1 and s["samples_per_client"]["max"] == 3
    assert s["clients_with_n_classes"] == {1: 1, 2: 2}


def _files(name, root):
    root.mkdir()
    if name == "mnist":
        write_mnist(root)
    elif name == "ham10000":
        write_ham(root)
    elif name == "matek19":
        write_matek(root / "AML-Cytomorphology_LMU")
    elif name in ("voc", "voc_macro"):
        write_voc(root)
    elif name == "voc_seg":
        write_voc_seg(root)
        return {"root": str(root)}
    return {"root": str(root), "image_size": 8} if name != "mnist" else {"root": str(root)}


@pytest.mark.parametrize("name", ["synthetic", "digits", "shapes", "mnist", "ham10000",
                                  "matek19", "voc", "voc_macro", "voc_seg"])
def test_stats_of_every_kind_of_dataset(name, tmp_path):
    extra = {"synthetic": {}, "digits": {}, "shapes": {"image_size": 32}}.get(name)
    extra = _files(name, tmp_path / "data") if extra is None else extra
    data = load_dataset(DataConfig(name=name, num_clients=3, **extra))
    s = write_stats(data, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "stats.json").read_text()) == json.loads(
        json.dumps(s))
    assert (tmp_path / "out" / "stats.png").stat().st_size > 0
    assert s["clients"] == 3 and sum(s["clients_with_n_classes"].values()) <= 3
    assert s["train_samples"] == int(data.train_sizes.sum())
