"""The embedded Shapes segmentation set: determinism, one object class per image, the macro
grouping, the federated layout, and that DeepLab-V3+ learns it."""

import time

import numpy as np
import torch
import torch.nn.functional as F

from protofl.config import DataConfig
from protofl.data.registry import DATASETS, dataset_spec, load_dataset
from protofl.data.shapes import MACRO_NAMES, SHAPE_CLASSES, generate_shapes
from protofl.metrics.segmentation import ConfusionMeter
from protofl.models.deeplab import DeepLabV3Plus


def test_generation_is_deterministic_and_single_class():
    x, m, lab = generate_shapes(64, 32, seed=5)
    x2, m2, lab2 = generate_shapes(64, 32, seed=5)
    assert np.array_equal(x, x2) and np.array_equal(m, m2) and np.array_equal(lab, lab2)
    assert not np.array_equal(generate_shapes(64, 32, seed=6)[1], m)
    assert x.shape == (64, 3, 32, 32) and x.dtype == np.uint8
    assert m.shape == (64, 32, 32) and m.dtype == np.uint8
    for mask, c in zip(m, lab):
        objects = set(np.unique(mask).tolist()) - {0, 255}
        assert objects == {int(c)}  # exactly one object class, the image's label
    assert set(np.unique(lab).tolist()) == set(range(1, 9))
    assert (m == 255).any()  # void outlines
    assert not (generate_shapes(8, 32, seed=5, void_edges=False)[1] == 255).any()


def test_generation_is_fast():
    t = time.perf_counter()
    generate_shapes(1500, 48, seed=1)
    assert time.perf_counter() - t < 10.0  # ~1 s on a free core


def test_federated_layout_and_macro():
    data = load_dataset(DataConfig(name="shapes", num_clients=6, alpha=0.1, image_size=32),
                        lean=True)
    assert data.task == "segmentation" and data.num_classes == 9
    assert data.class_names == ["background", *SHAPE_CLASSES]
    assert data.x_train.dtype == torch.uint8 and data.y_train.dtype == torch.uint8
    assert data.num_clients == 6 and len(data.x_test) == 300
    assert data.class_counts.sum() == len(data.y_train)
    macro = load_dataset(DataConfig(name="shapes_macro", num_clients=6, alpha=0.1,
                                    image_size=32))
    assert macro.num_classes == 5 and macro.class_names == list(MACRO_NAMES)
    # the same images; macro labels by hand: disc, ring round; square, diamond boxy;
    # triangle, star pointy; cross, bar linear
    group = {0: 0, 255: 255, 1: 1, 2: 1, 3: 2, 4: 2, 5: 3, 6: 3, 7: 4, 8: 4}
    want = np.vectorize(group.get)(data.y_test.numpy())
    assert np.array_equal(macro.y_test.numpy(), want)
    assert macro.labels_test.tolist() == [group[c] for c in data.labels_test.tolist()]
    for name in ("shapes", "shapes_macro", "voc_seg", "voc_seg_macro"):
        assert dataset_spec(name).task == "segmentation" and name in DATASETS
        assert "segmentation" in dataset_spec(name).description
    assert dataset_spec("digits").task == "classification"


def test_deeplab_learns_shapes():
    """Central training for a short budget (150 Adam steps, ~12 s on a free core) beats the
    all-background prediction clearly (benchmarks/shapes_central.py trains longer: mIoU
    ~0.86 on the 9 classes). Deterministic: one thread, fixed seeds."""
    torch.manual_seed(0)
    data = load_dataset(DataConfig(name="shapes_macro", num_clients=1, image_size=32,
                                   max_samples=600), lean=True)
    model = DeepLabV3Plus(data.input_shape, data.num_classes, width=0.35, channels=32)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    gen = torch.Generator().manual_seed(0)

    def inputs(x):
        return (x.float() / 255 - 0.5) / 0.25

    for _ in range(150):
        idx = torch.randint(len(data.x_train), (32,), generator=gen)
        loss = F.cross_entropy(model(inputs(data.x_train[idx]))[1],
                               data.y_train[idx].long(), ignore_index=255)
        opt.zero_grad()
        loss.backward()
        opt.step()
    x, y = data.x_test[:150], data.y_test[:150]
    trained, background = ConfusionMeter(5), ConfusionMeter(5)
    with torch.no_grad():
        trained.update(y, model(inputs(x))[1])
    background.update(y, torch.zeros_like(y))
    base, got = background.report()["miou"], trained.report()["miou"]
    print(f"mIoU {got:.3f} vs all-background {base:.3f}")  # 0.600 vs 0.170 here
    assert base < 0.2
    assert got > 2.5 * base, (got, base)
