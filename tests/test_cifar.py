"""CIFAR-10, CIFAR-100 and Tiny-ImageNet loaders on tiny files written here in the exact
published formats, the restricted unpickler, channel statistics, partitions, the embedded
``cifar_tiny`` stand-in and the FedTGP configs."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from protofl.cli import main
from protofl.config import DataConfig, config_from_dict, load_raw
from protofl.data import cifar
from protofl.data.cifar import CIFAR10, CIFAR100, channel_stats, load_cifar
from protofl.data.registry import dataset_spec, load_dataset
from protofl.errors import ProtoflError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


# ---------------------------------------------------------------- writers (the published formats)
def _dump(path: Path, obj, protocol: int = 3) -> None:
    """A pickle like the published batches: a dict with byte-string keys, a numpy array.

    Protocol 3 writes the numpy reconstructor as a GLOBAL line; the released files (pickled
    by Python 2 with numpy < 2) name it ``numpy.core.multiarray``, which is what we write."""
    raw = pickle.dumps(obj, protocol=protocol)
    raw = raw.replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")
    path.write_bytes(raw)


def _images(rng, n: int) -> np.ndarray:
    return rng.integers(0, 256, (n, 3072), dtype=np.uint8)


def write_cifar10(folder: Path, per_batch: int = 8, n_test: int = 10, seed: int = 0) -> dict:
    """data_batch_1..5, test_batch and batches.meta in cifar-10-batches-py/ layout."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for i, name in enumerate([f"data_batch_{b}" for b in range(1, 6)] + ["test_batch"]):
        n = n_test if name == "test_batch" else per_batch
        data = _images(rng, n)
        labels = [int(v) for v in (np.arange(n) + i) % 10]  # a Python list, as released
        _dump(folder / name, {b"batch_label": f"batch {i}".encode(), b"labels": labels,
                              b"data": data, b"filenames": [b"x.png"] * n})
        out[name] = (data, labels)
    _dump(folder / "batches.meta", {b"label_names": [b"airplane", b"automobile", b"bird",
                                                     b"cat", b"deer", b"dog", b"frog",
                                                     b"horse", b"ship", b"truck"],
                                    b"num_cases_per_batch": per_batch, b"num_vis": 3072})
    return out


def write_cifar100(folder: Path, n_train: int = 60, n_test: int = 20, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, n in (("train", n_train), ("test", n_test)):
        data = _images(rng, n)
        fine = [int(v) for v in rng.integers(0, 100, n)]
        _dump(folder / name, {b"filenames": [b"f.png"] * n, b"batch_label": b"training",
                              b"fine_labels": fine, b"coarse_labels": [f // 5 for f in fine],
                              b"data": data})
        out[name] = (data, fine)
    _dump(folder / "meta", {b"fine_label_names": [f"c{i}".encode() for i in range(100)],
                            b"coarse_label_names": [f"s{i}".encode() for i in range(20)]})
    return out


# ---------------------------------------------------------------- CIFAR-10 / CIFAR-100
def test_cifar10_reads_the_published_layout(tmp_path):
    written = write_cifar10(tmp_path / "cifar-10-batches-py")
    x, y, xt, yt, names = load_cifar(tmp_path, CIFAR10)  # the archive's top folder is found
    assert x.shape == (40, 3, 32, 32) and x.dtype == np.uint8 and xt.shape == (10, 3, 32, 32)
    assert names[0] == "airplane" and names[9] == "truck"
    data, labels = written["data_batch_2"]
    row = data[3]  # batch 2 follows the 8 rows of batch 1: overall row 11
    assert np.array_equal(x[8 + 3, 0], row[:1024].reshape(32, 32))  # red plane
    assert np.array_equal(x[8 + 3, 1], row[1024:2048].reshape(32, 32))  # green
    assert np.array_equal(x[8 + 3, 2, 5], row[2048 + 5 * 32: 2048 + 6 * 32])  # blue, row 5
    assert y[8 + 3] == labels[3] and y.dtype == np.int64
    assert yt.tolist() == written["test_batch"][1]


def test_cifar10_federation_is_uint8_standardised_and_dirichlet(tmp_path):
    write_cifar10(tmp_path, per_batch=40)
    data = load_dataset(DataConfig(name="cifar10", root=str(tmp_path), num_clients=4,
                                   alpha=0.3), lean=True)
    assert data.num_clients == 4 and data.x_train.dtype == torch.uint8
    assert data.input_shape == (3, 32, 32) and data.num_classes == 10
    assert len(data.y_train) + len(data.y_local_test) == 200 and len(data.y_test) == 10
    pool = np.concatenate([data.x_train.numpy(), data.x_local_test.numpy()]) / 255.0
    assert np.allclose(data.mean, pool.mean(axis=(0, 2, 3)), atol=1e-12)
    assert np.allclose(data.std, pool.std(axis=(0, 2, 3)), atol=1e-12)
    z = data.inputs(data.x_train)  # standardised per channel
    assert abs(float(z[:, 0].mean())) < 0.1
    spec = dataset_spec("cifar10")
    assert spec.partition == "dirichlet" and spec.augment == "crop_flip"
    assert spec.model == "resnet18"
    assert load_dataset(DataConfig(name="cifar10", root=str(tmp_path),
                                   partition="iid")).num_clients == 20  # the default count


def test_pathological_partition_gives_k_classes_per_client(tmp_path):
    write_cifar10(tmp_path, per_batch=60)
    data = load_dataset(DataConfig(name="cifar10", root=str(tmp_path), num_clients=10,
                                   partition="classes", classes_per_client=2,
                                   local_test_fraction=0.0))
    per_client = (data.class_counts > 0).sum(1)
    assert per_client.max() == 2 and per_client.min() >= 1
    skew = load_dataset(DataConfig(name="cifar10", root=str(tmp_path), num_clients=5,
                                   alpha=0.05, local_test_fraction=0.0))
    iid = load_dataset(DataConfig(name="cifar10", root=str(tmp_path), num_clients=5,
                                  partition="iid", local_test_fraction=0.0))
    assert (skew.class_counts > 0).sum(1).mean() < (iid.class_counts > 0).sum(1).mean()


def test_cifar100_fine_labels_and_names(tmp_path):
    written = write_cifar100(tmp_path / "cifar-100-python")
    x, y, xt, yt, names = load_cifar(tmp_path, CIFAR100)
    assert x.shape == (60, 3, 32, 32) and y.tolist() == written["train"][1]
    assert yt.tolist() == written["test"][1] and names[7] == "c7" and len(names) == 100
    data = load_dataset(DataConfig(name="cifar100", root=str(tmp_path / "cifar-100-python"),
                                   num_clients=3, partition="iid"))
    assert data.num_classes == 100 and data.class_names[42] == "c42"


def _one_line_exit_2(capsys, args: list[str], needle: str) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("damage,needle", [
    ("missing", "lacks data_batch_3"),
    ("truncated", "truncated or corrupt"),
    ("shape", "expected uint8 N x 3072"),
    ("dtype", "expected uint8 N x 3072"),
    ("labels", "outside 0..9"),
    ("count", "expected 8 integer labels"),
    ("nolabels", "has no b'labels' entry"),
    ("notdict", "holds a list, expected a dict"),
])
def test_bad_cifar_files_are_one_line_exit_2(tmp_path, capsys, damage, needle):
    write_cifar10(tmp_path)
    path = tmp_path / "data_batch_3"
    good = {b"labels": [0] * 8, b"data": np.zeros((8, 3072), np.uint8)}
    if damage == "missing":
        path.unlink()
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:2000])
    elif damage == "shape":
        _dump(path, {**good, b"data": np.zeros((8, 3071), np.uint8)})
    elif damage == "dtype":
        _dump(path, {**good, b"data": np.zeros((8, 3072), np.float32)})
    elif damage == "labels":
        _dump(path, {**good, b"labels": [0] * 7 + [10]})
    elif damage == "count":
        _dump(path, {**good, b"labels": [0] * 7})
    elif damage == "nolabels":
        _dump(path, {b"data": good[b"data"]})
    else:
        _dump(path, [1, 2, 3])
    _one_line_exit_2(capsys, ["stats", "--dataset", "cifar10", "--set",
                              f"data.root={tmp_path}", "--set", "data.num_clients=2"], needle)


def test_cifar100_coarse_labels_are_checked(tmp_path):
    write_cifar100(tmp_path)
    d = pickle.loads((tmp_path / "test").read_bytes())
    d[b"coarse_labels"][0] = 20
    _dump(tmp_path / "test", d)
    with pytest.raises(ProtoflError, match=r"b'coarse_labels' has labels in .*outside 0..19"):
        load_cifar(tmp_path, CIFAR100)


class _Evil:
    """Unpickles as ``open(target, "w")``: a file appears when the pickle is loaded."""

    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    write_cifar10(tmp_path)
    _dump(tmp_path / "test_batch", {b"labels": [0], b"data": _Evil(str(tmp_path / "pwned"))})
    pickle.loads((tmp_path / "test_batch").read_bytes())[b"data"].close()  # plain pickle runs it
    assert (tmp_path / "pwned").exists()
    (tmp_path / "pwned").unlink()
    with pytest.raises(ProtoflError, match=r"not a plain CIFAR batch: refused to load global "
                                           r"(builtins|io)\.open"):
        load_cifar(tmp_path, CIFAR10)
    assert not (tmp_path / "pwned").exists()
    raw = pickle.dumps({b"data": 1}, protocol=3).replace(b"}", b"cos\nsystem\n", 1)
    (tmp_path / "test_batch").write_bytes(raw)
    with pytest.raises(ProtoflError, match="refused to load global os.system"):
        cifar.load_batch(tmp_path / "test_batch")


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_batches_pickled_by_python3_load_too(tmp_path, protocol):
    """Re-pickled batches (Python 3 bytes at protocol 2, numpy's protocol-5 reduction) are
    read; a codec other than latin-1 inside ``_codecs.encode`` is refused."""
    data = np.arange(2 * 3072, dtype=np.int64).astype(np.uint8).reshape(2, 3072)
    path = tmp_path / "b"
    path.write_bytes(pickle.dumps({b"labels": [3, 4], b"data": data}, protocol=protocol))
    x, y = cifar.read_batch(path, CIFAR10)
    assert np.array_equal(x.reshape(2, -1), data) and y.tolist() == [3, 4]
    if protocol == 2:
        path.write_bytes(path.read_bytes().replace(b"latin1", b"rot_13"))
        with pytest.raises(ProtoflError, match="not a plain CIFAR batch: refused codec 'rot_13'"):
            cifar.load_batch(path)


def test_image_size_other_than_32_is_refused(tmp_path):
    write_cifar10(tmp_path)
    with pytest.raises(ProtoflError, match="CIFAR-10 images are 32 x 32"):
        load_dataset(DataConfig(name="cifar10", root=str(tmp_path), image_size=64))


def test_channel_stats_match_numpy():
    rng = np.random.default_rng(3)
    a = torch.from_numpy(rng.integers(0, 256, (7, 3, 5, 4), dtype=np.uint8))
    b = torch.from_numpy(rng.integers(100, 120, (2, 3, 5, 4), dtype=np.uint8))
    mean, std = channel_stats([a, b])
    both = np.concatenate([a.numpy(), b.numpy()]).astype(np.float64) / 255
    assert np.allclose(mean, both.mean(axis=(0, 2, 3)), rtol=0, atol=1e-14)
    assert np.allclose(std, both.std(axis=(0, 2, 3)), rtol=0, atol=1e-12)
    # by hand: one channel holding 0 and 255 -> mean 0.5, std 0.5; a constant channel -> std 1
    x = torch.tensor([[[[0]], [[7]]], [[[255]], [[7]]]], dtype=torch.uint8)
    mean, std = channel_stats([x])
    assert mean == (0.5, 7 / 255) and std == (0.5, 1.0)


# ---------------------------------------------------------------- Tiny-ImageNet
WNIDS = ["n01443537", "n01629819", "n01641577"]
COLOURS = [(220, 30, 30), (30, 200, 40), (40, 40, 210)]


def write_tiny(root: Path, per_class: int = 4, side: int = 64) -> Path:
    """tiny-imagenet-200/ with wnids.txt, words.txt, train/<wnid>/images/*.JPEG (+ the
    boxes file), val/images + val_annotations.txt and an unlabelled test/images/."""
    from PIL import Image

    top = root / "tiny-imagenet-200"
    (top / "val" / "images").mkdir(parents=True)
    (top / "test" / "images").mkdir(parents=True)
    (top / "wnids.txt").write_text("\n".join(WNIDS) + "\n")
    (top / "words.txt").write_text("n01443537\tgoldfish, Carassius auratus\n"
                                   "n01629819\tEuropean fire salamander\n"
                                   "n09999999\tnot in this set\n")
    for k, w in enumerate(WNIDS):
        d = top / "train" / w / "images"
        d.mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (side, side), COLOURS[k]).save(d / f"{w}_{i}.JPEG")
        (top / "train" / w / f"{w}_boxes.txt").write_text("")
    lines = []
    for i in range(6):
        name = f"val_{i}.JPEG"
        k = i % 3
        im = Image.new("RGB", (side, side), COLOURS[k])
        (im.convert("L") if i == 5 else im).save(top / "val" / "images" / name)
        lines.append(f"{name}\t{WNIDS[k]}\t0\t0\t{side - 1}\t{side - 1}")
    (top / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    Image.new("RGB", (side, side)).save(top / "test" / "images" / "test_0.JPEG")
    return top


def test_tinyimagenet_reads_the_folder_layout(tmp_path):
    write_tiny(tmp_path)
    data = load_dataset(DataConfig(name="tinyimagenet", root=str(tmp_path), num_clients=2,
                                   alpha=1.0, local_test_fraction=0.0), lean=True)
    assert data.num_classes == 3 and data.input_shape == (3, 64, 64)
    assert data.x_train.dtype == torch.uint8 and len(data.y_train) == 12
    assert data.class_names == ["goldfish", "European fire salamander", "n01641577"]
    assert len(data.y_test) == 6 and data.y_test.tolist() == [0, 1, 2, 0, 1, 2]  # val = test
    for x, y in zip(data.x_train, data.y_train):  # each label has its class's colour
        mean = x.float().mean(dim=(1, 2)).numpy()
        assert np.abs(mean - COLOURS[int(y)]).max() < 6
    grey = data.x_test[5].float()  # a greyscale JPEG comes back as RGB, equal channels
    assert grey.shape == (3, 64, 64) and torch.equal(grey[0], grey[1])
    small = load_dataset(DataConfig(name="tinyimagenet", root=str(tmp_path / "tiny-imagenet-200"),
                                    num_clients=2, image_size=32, max_samples=6))
    assert small.input_shape == (3, 32, 32)
    assert len(small.y_train) + len(small.y_local_test) == 6


@pytest.mark.parametrize("damage,needle", [
    ("wnids", "no wnids.txt"),
    ("class", "has no folder"),
    ("empty", "holds no .JPEG image"),
    ("annotation", "wnid 'n00000000' is not in wnids.txt"),
    ("valimage", "image(s) of val_annotations.txt missing"),
    ("noval", "val_annotations.txt does not exist"),
    ("corrupt", "cannot be read"),
])
def test_bad_tinyimagenet_files_are_one_line_exit_2(tmp_path, capsys, damage, needle):
    top = write_tiny(tmp_path)
    if damage == "wnids":
        (top / "wnids.txt").unlink()
    elif damage == "class":
        (top / "wnids.txt").write_text("\n".join(WNIDS + ["n02000000"]))
    elif damage == "empty":
        for p in (top / "train" / WNIDS[1] / "images").iterdir():
            p.unlink()
    elif damage == "annotation":
        with open(top / "val" / "val_annotations.txt", "a") as f:
            f.write("val_0.JPEG\tn00000000\t0\t0\t1\t1\n")
    elif damage == "valimage":
        (top / "val" / "images" / "val_2.JPEG").unlink()
    elif damage == "noval":
        (top / "val" / "val_annotations.txt").unlink()
    else:
        (top / "train" / WNIDS[0] / "images" / f"{WNIDS[0]}_1.JPEG").write_bytes(b"\xff\xd8junk")
    _one_line_exit_2(capsys, ["stats", "--dataset", "tinyimagenet", "--set",
                              f"data.root={tmp_path}", "--set", "data.num_clients=2"], needle)


# ---------------------------------------------------------------- cifar_tiny
def test_cifar_tiny_is_deterministic_listed_and_needs_no_files(capsys):
    a = load_dataset(DataConfig(name="cifar_tiny"), lean=True)
    b = load_dataset(DataConfig(name="cifar_tiny"), lean=True)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_train, b.y_train)
    assert a.mean == b.mean and a.std == b.std
    assert a.x_train.dtype == torch.uint8 and a.input_shape == (3, 32, 32)
    assert a.num_clients == 10 and a.num_classes == 10 and len(a.y_test) == 200
    assert len(a.y_train) + len(a.y_local_test) == 600
    assert np.bincount(a.y_test.numpy()).tolist() == [20] * 10
    moved = load_dataset(DataConfig(name="cifar_tiny", seed=1), lean=True)
    assert torch.equal(moved.x_test, a.x_test)  # data.seed moves the partition, not the set
    assert not torch.equal(moved.y_train, a.y_train)
    assert main(["datasets"]) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("cifar_tiny"))
    assert "classification" in line and "built in" in line


def test_cifar_tiny_needs_texture_not_only_colour():
    """Mean colour alone (nearest class centroid) stays far below a texture-aware classifier
    (nearest centroid of the grey image's Fourier magnitudes, which ignore the phase)."""
    x, y = cifar.generate_tiny_images(600, cifar.TINY_TRAIN_SEED)
    xt, yt = cifar.generate_tiny_images(200, cifar.TINY_TEST_SEED)

    def centroid_accuracy(f, ft):
        c = np.stack([f[y == k].mean(0) for k in range(10)])
        return float((((ft[:, None] - c[None]) ** 2).sum(-1).argmin(1) == yt).mean())

    colour = centroid_accuracy(x.reshape(600, 3, -1).mean(-1), xt.reshape(200, 3, -1).mean(-1))

    def spectrum(a):
        g = a.astype(np.float64).mean(1)
        return np.abs(np.fft.fft2(g - g.mean(axis=(1, 2), keepdims=True))).reshape(len(a), -1)

    texture = centroid_accuracy(spectrum(x), spectrum(xt))
    assert colour < 0.6 and texture > 0.85, (colour, texture)


def test_cifar_tiny_trains_with_the_default_pipeline(tmp_path):
    """fedavg on the stand-in with its defaults (leaf_cnn, crop_flip, standardised inputs):
    three rounds beat chance (10%) clearly (0.355; about 12 s of CPU)."""
    out = tmp_path / "run"
    assert main(["run", "-q", "--algorithm", "fedavg", "--dataset", "cifar_tiny", "--rounds",
                 "3", "--out", str(out), "--set", "clients.per_round=10", "--set",
                 "clients.batch_size=10", "--set", "clients.local_epochs=1", "--set",
                 "clients.lr=0.05", "--set", "clients.momentum=0.9", "--set",
                 "data.alpha=5.0", "--set", "metrics.dissimilarity_clients=0", "--set",
                 "metrics.train_loss_samples=0"]) == 0
    from protofl.engine.runfolder import read_metrics

    rows = read_metrics(out)
    assert rows[-1]["accuracy"] > 0.25, [r["accuracy"] for r in rows]


# ---------------------------------------------------------------- configs
@pytest.mark.parametrize("name,dataset", [("cifar10", "cifar10"), ("cifar100", "cifar100"),
                                          ("tinyimagenet", "tinyimagenet")])
def test_fedtgp_configs_load_and_build(tmp_path, name, dataset):
    path = CONFIGS / f"{name}.yaml"
    text = path.read_text()
    assert "data.root must hold" in text and "FedTGP" in text
    cfg = config_from_dict(load_raw(path))
    assert cfg.data.name == dataset and cfg.data.num_clients == 20 and cfg.data.alpha == 0.1
    assert cfg.data.partition == "dirichlet" and cfg.rounds == 1000
    assert cfg.clients.per_round == 20 and cfg.clients.local_epochs == 1
    assert cfg.clients.batch_size == 10 and cfg.clients.lr == 0.01
    if dataset == "tinyimagenet":
        write_tiny(tmp_path, per_class=20, side=16)
    elif dataset == "cifar10":
        write_cifar10(tmp_path, per_batch=60)
    else:
        write_cifar100(tmp_path, n_train=400)
    from dataclasses import replace

    data = load_dataset(replace(cfg.data, root=str(tmp_path), alpha=1.0, num_clients=3))
    assert data.num_clients == 3
