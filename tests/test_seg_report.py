"""Segmentation figures: the VOC colormap, the qualitative figure and the Fig. S1 panels."""

import numpy as np
import pytest
import torch

from protofl.config import DataConfig
from protofl.data.shapes import shapes_federation
from protofl.errors import ProtoflError
from protofl.report.segmentation import (
    colorize,
    maps_from_outputs,
    partition_figure,
    qualitative_figure,
    voc_colormap,
)
from protofl.report.stats import partition_stats


def test_voc_colormap_known_colours():
    cmap = voc_colormap()
    # Pascal VOC's published colours: background, aeroplane, bicycle, bird, person, void
    assert cmap[0].tolist() == [0, 0, 0]
    assert cmap[1].tolist() == [128, 0, 0]
    assert cmap[2].tolist() == [0, 128, 0]
    assert cmap[3].tolist() == [128, 128, 0]
    assert cmap[15].tolist() == [192, 128, 128]
    assert cmap[255].tolist() == [224, 224, 192]
    assert colorize(np.array([[1, 255]])).tolist() == [[[128, 0, 0], [224, 224, 192]]]


def test_qualitative_figure(tmp_path):
    torch.manual_seed(0)
    n, c = 3, 5
    images = torch.randint(0, 256, (n, 3, 16, 16), dtype=torch.uint8)
    truth = torch.randint(0, c, (n, 16, 16))
    truth[:, 0] = 255
    methods = {}
    for name in ("fedavg", "fedmargin", "central"):
        z, logits = torch.rand(n, 8, 4, 4), torch.randn(n, c, 16, 16)
        maps = maps_from_outputs(z, logits)
        assert maps["pred"].shape == maps["feature_entropy"].shape == (n, 16, 16)
        methods[name] = maps
    path = qualitative_figure(images, truth, methods, tmp_path / "fig" / "qual.png",
                              ["bg", "a", "b", "c", "d"], title="test")
    assert path.stat().st_size > 5000
    bad = {"fedavg": {"pred": methods["fedavg"]["pred"]}}
    with pytest.raises(ProtoflError, match="needs pred, softmax_entropy, feature_entropy"):
        qualitative_figure(images, truth, bad, tmp_path / "x.png")


def test_partition_figures_on_segmentation_data(tmp_path):
    splits = {f"alpha = {a}": shapes_federation(DataConfig(name="shapes", alpha=a,
                                                           num_clients=12, image_size=16))
              for a in (0.01, 1.0)}
    low, high = splits.values()
    assert low.task == "segmentation" and low.class_counts[:, 0].sum() == 0
    assert low.class_counts.sum() == len(low.y_train)
    # alpha 0.01 concentrates each client on fewer object classes than alpha 1
    assert (low.class_counts > 0).sum(1).mean() < (high.class_counts > 0).sum(1).mean()
    assert partition_figure(splits, tmp_path / "s1.png", clients=10).stat().st_size > 5000
    text = partition_stats(low, tmp_path / "stats")
    assert "12 clients, 9 classes" in text and (tmp_path / "stats" / "stats.png").exists()
