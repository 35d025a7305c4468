"""Segmentation data for training: uint8 rows standardised by ``FederatedData.inputs``, the
cache keeping per-image labels and the standardisation, and the data-level crop-and-flip
transform composed with an algorithm's."""

import numpy as np
import pytest
import torch
from test_loaders_voc_seg import write_voc

from protofl.config import DataConfig
from protofl.data import store
from protofl.data.federated import from_partition
from protofl.data.images import IMAGENET_MEAN, IMAGENET_STD
from protofl.data.pipeline import augmentation, compose
from protofl.data.registry import load_dataset
from protofl.data.seg_augment import CropFlip, crop_flip_params, crop_flip_transform, warp_pair
from protofl.errors import ProtoflError

MEAN, STD = (0.5, 0.25, 0.0), (0.5, 0.25, 2.0)


def rows():
    x = torch.tensor([0, 51, 255], dtype=torch.uint8).reshape(1, 3, 1, 1).repeat(4, 1, 2, 2)
    y = torch.zeros(4, 2, 2, dtype=torch.uint8)
    return x, y


def test_inputs_standardise_each_channel():
    x, y = rows()
    d = from_partition("t", 2, x, y, [np.arange(4)], scale=255.0, mean=MEAN, std=STD,
                       local_test_fraction=0.0)
    got = d.inputs(d.x_train)
    # channel c: (v / 255 - mean_c) / std_c, by hand
    want = torch.tensor([(0 - 0.5) / 0.5, (0.2 - 0.25) / 0.25, (1.0 - 0.0) / 2.0])
    assert torch.allclose(got[:, :, 0, 0], want.expand(4, 3), atol=1e-6)
    # rows gathered as (clients, batch, C, H, W) by the vectorized trainer
    assert torch.equal(d.inputs(d.x_train[torch.tensor([[0, 1], [2, 3]])]).reshape(4, 3, 2, 2),
                       got)
    assert torch.equal(d.decoded().x_train, got) and d.pooled().mean == MEAN


@pytest.mark.parametrize("kw", [{"mean": MEAN}, {"mean": MEAN, "std": (1.0, 0.0, 1.0)},
                                {"mean": MEAN[:2], "std": STD}])
def test_bad_standardisation_is_refused(kw):
    x, y = rows()
    with pytest.raises(ProtoflError, match="mean and std"):
        from_partition("t", 2, x, y, [np.arange(4)], scale=255.0, local_test_fraction=0.0,
                       **kw)


def test_segmentation_sets_store_uint8_and_standardise():
    d = load_dataset(DataConfig(name="shapes", image_size=16, num_clients=3), lean=True)
    assert d.x_train.dtype == torch.uint8 and d.scale == 255.0
    assert d.mean == IMAGENET_MEAN and d.std == IMAGENET_STD
    assert d.inputs(d.x_test[:2]).dtype == torch.float32


def test_cache_keeps_labels_and_standardisation(tmp_path, monkeypatch):
    monkeypatch.setenv(store.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(store.BUDGET_ENV, "0.001")  # ~1 KiB: the splits go to disk
    write_voc(tmp_path)
    cfg = DataConfig(name="voc_seg", root=str(tmp_path), num_clients=3, image_size=8)
    built = load_dataset(cfg, lean=True)
    cached = load_dataset(cfg, lean=True)
    assert store.mapped_file(cached.x_train) is not None
    for d in (built, cached):
        assert d.mean == IMAGENET_MEAN and d.std == IMAGENET_STD and d.scale == 255.0
        assert torch.equal(d.labels_train, load_dataset(cfg).labels_train)
    assert np.array_equal(cached.class_counts, built.class_counts)
    assert torch.equal(cached.labels_test, built.labels_test)


def test_crop_flip_transform_moves_masks_with_images_and_keeps_class_labels():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(3, 3, 8, 8)
    m = torch.randint(0, 4, (3, 8, 8), dtype=torch.uint8)
    t = crop_flip_transform()
    xa, ma = t(x, m, torch.Generator().manual_seed(5), torch.empty(0))
    theta = crop_flip_params(3, 8, 8, CropFlip(), torch.Generator().manual_seed(5))
    xw, mw = warp_pair(x, m, theta)
    assert torch.equal(xa, xw) and torch.equal(ma, mw) and ma.dtype == torch.uint8
    labels = torch.tensor([1, 0, 2])
    xb, lb = t(x, labels, torch.Generator().manual_seed(5), torch.empty(0))
    assert torch.equal(xb, xw) and lb is labels
    with pytest.raises(ProtoflError, match="images"):
        t(torch.rand(3, 5), labels, g, torch.empty(0))


def test_compose_runs_the_data_transform_first_on_one_generator():
    calls = []

    def tag(name):
        def f(x, y, gen, counts):
            calls.append((name, float(torch.rand(1, generator=gen))))
            return x + 1, y
        return f

    assert compose(None, None) is None and compose(None, tag("a")) is not None
    run = compose(tag("data"), None, tag("alg"))
    x, _ = run(torch.zeros(1), torch.zeros(1), torch.Generator().manual_seed(3), torch.empty(0))
    g = torch.Generator().manual_seed(3)
    assert [c[0] for c in calls] == ["data", "alg"] and x.item() == 2
    assert [c[1] for c in calls] == [float(torch.rand(1, generator=g)) for _ in range(2)]
    assert augmentation("none") is None and augmentation("crop_flip") is not None
    with pytest.raises(ProtoflError, match="data.augment"):
        augmentation("mixup")
