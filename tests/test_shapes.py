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
    t = time.process_time()  # CPU time: a shared machine's load does not count
    generate_shapes(1500, 48, seed=1)
    assert time.process_time() - t < 10.0  # ~1 s


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


def _hues(x: np.ndarray, m: np.ndarray, k: int) -> np.ndarray:
    """The hue (HSV, in [0, 1)) of every pixel of object class ``k``, worked out here."""
    rgb = x.transpose(0, 2, 3, 1)[m == k].astype(float) / 255
    mx, mn = rgb.max(1), rgb.min(1)
    d = np.maximum(mx - mn, 1e-9)
    r, g, b = rgb.T
    h = np.where(mx == r, (g - b) / d % 6, np.where(mx == g, (b - r) / d + 2, (r - g) / d + 4))
    return h / 6 % 1.0


def test_classes_of_a_macro_group_share_colours_and_textures():
    """Version 2: both classes of a macro group use the same two hues (and the same two
    textures), the groups' hues are apart; version 1 gave every class a hue of its own."""
    from protofl.data.shapes import GROUP_HUES, _looks

    x, m, lab = generate_shapes(400, 32, seed=7, void_edges=False)
    centres = np.array(GROUP_HUES).ravel()  # 8 hues: group g has entries 2g, 2g + 1
    used = {}
    for k in range(1, 9):
        h = _hues(x, m, k)
        dist = np.abs((h[:, None] - centres[None] + 0.5) % 1.0 - 0.5)
        near = dist.argmin(1)
        assert (dist.min(1) < 0.05).mean() > 0.95, k  # every pixel near one of the 8 hues
        share = np.bincount(near, minlength=8) / len(near)
        used[k] = {i for i in range(8) if share[i] > 0.1}
        g = (k - 1) // 2
        assert used[k] == {2 * g, 2 * g + 1}, (k, share.round(2))
    assert used[1] == used[2] and used[3] == used[4] and used[1] != used[3]
    _, _, tex = _looks(np.random.default_rng(0), np.repeat(np.arange(1, 9), 200), 2)
    for k in range(8):
        assert set(tex[k * 200:(k + 1) * 200].tolist()) == {k // 2 * 2, k // 2 * 2 + 1}
    x1, m1, _ = generate_shapes(400, 32, seed=7, void_edges=False, version=1)
    for k, hue in ((1, 0.0), (2, 1 / 8)):  # one hue per class, eight around the circle
        near = np.abs((_hues(x1, m1, k) - hue + 0.5) % 1.0 - 0.5) < 0.05
        assert near.mean() > 0.95, k


def test_version_1_is_the_first_generator():
    """The first generator's images exactly (the digest of its output, taken before the
    second version was written), and shapes_v1 reads them."""
    import hashlib

    x, m, _ = generate_shapes(50, 32, seed=5, void_edges=False, version=1)
    assert hashlib.md5(x.tobytes() + m.tobytes()).hexdigest() == (
        "7802ab417d9c478822ba6537ba62621c")
    old = load_dataset(DataConfig(name="shapes_v1", image_size=16, num_clients=3), lean=True)
    new = load_dataset(DataConfig(name="shapes", image_size=16, num_clients=3), lean=True)
    assert old.name == "shapes_v1" and 1.95 < len(new.x_train) / len(old.x_train) < 2.05
    assert not torch.equal(old.x_test, new.x_test)
    macro = load_dataset(DataConfig(name="shapes_macro_v1", image_size=16, num_clients=3))
    assert macro.num_classes == 5


def test_pretraining_set_shares_no_image_with_train_or_test():
    from protofl.data.shapes import (
        SHAPES_TEST,
        SHAPES_TRAIN,
        TEST_SEED,
        TRAIN_SEED,
        pretraining_set,
    )

    def digests(x):
        return {hash(im.tobytes()) for im in x}

    pre = digests(pretraining_set(600, 16)[0])
    train = digests(generate_shapes(SHAPES_TRAIN[2], 16, seed=TRAIN_SEED)[0])
    test = digests(generate_shapes(SHAPES_TEST, 16, seed=TEST_SEED)[0])
    assert len(pre) == 600 and not pre & train and not pre & test and not train & test


def test_a_hundred_clients_hold_ten_images_each():
    data = load_dataset(DataConfig(name="shapes", image_size=16, num_clients=100, alpha=0.01),
                        lean=True)
    assert data.num_clients == 100 and data.train_sizes.min() >= 10
