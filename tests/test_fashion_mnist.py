"""Fashion-MNIST: tiny IDX files written in the exact format, the published-content check,
Debian's folder as the default root, `protofl data fetch fashion-mnist`; the lenet5 model."""

from __future__ import annotations

import gzip
import hashlib
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from protofl.cli import main
from protofl.config import DataConfig
from protofl.data import fetch as F
from protofl.data import mnist
from protofl.data.registry import DATASETS, load_dataset
from protofl.data.sources import SOURCES
from protofl.errors import ProtoflError
from protofl.models.registry import build_model
from tests import test_fetch

STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
         "t10k-labels-idx1-ubyte")
DEBIAN = Path("/usr/share/datasets/fashion-mnist")
server = test_fetch.server  # the fetch tests' local HTTP server (a fixture)


def idx(arr: np.ndarray) -> bytes:
    """IDX bytes written independently of the reader: 0, 0, 0x08 (ubyte), ndim, sizes."""
    return (bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
            + arr.astype(np.uint8).tobytes())


def write_fashion(root: Path, n_train=200, n_test=40, gz=True) -> dict[str, bytes]:
    rng = np.random.default_rng(1)
    arrays = [rng.integers(0, 256, (n_train, 28, 28)), np.arange(n_train) % 10,
              rng.integers(0, 256, (n_test, 28, 28)), (np.arange(n_test) * 3) % 10]
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for stem, a in zip(STEMS, arrays):
        out[stem] = idx(a)
        if gz:
            (root / f"{stem}.gz").write_bytes(gzip.compress(out[stem]))
        else:
            (root / stem).write_bytes(out[stem])
    return out


def test_federation_defaults_to_ten_dirichlet_clients_and_named_classes(tmp_path):
    raw = write_fashion(tmp_path)
    data = load_dataset(DataConfig(name="fashion-mnist", root=str(tmp_path)), lean=True)
    assert data.num_clients == 10 and data.num_classes == 10
    assert data.class_names[0] == "T-shirt/top" and data.class_names[9] == "Ankle boot"
    assert data.x_train.dtype == torch.uint8 and data.scale == 255.0
    assert len(data.x_train) + len(data.x_local_test) == 200
    # the global test set is the t10k file, byte for byte
    test = np.frombuffer(raw["t10k-images-idx3-ubyte"], np.uint8, offset=16)
    assert np.array_equal(data.x_test.numpy().ravel(), test)
    assert data.y_test.tolist() == [(3 * i) % 10 for i in range(40)]


def test_published_size_with_other_content_is_refused(tmp_path):
    write_fashion(tmp_path, gz=False)
    # a label file of the published size (60,000 labels) that is not the published one, as
    # MNIST's digits (same names and sizes) would be
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(idx(np.zeros(60000, np.uint8)))
    with pytest.raises(ProtoflError, match=r"train-labels-idx1-ubyte has the published "
                                           r"file's size but not its content: MD5 \w{32}"):
        mnist.fashion_mnist_federation(DataConfig(name="fashion-mnist", root=str(tmp_path)))


def test_null_root_reads_the_packaged_folder(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "pkg"
    write_fashion(folder)
    monkeypatch.setitem(DATASETS, "fashion-mnist", replace(DATASETS["fashion-mnist"],
                                                           root=str(folder)))
    assert load_dataset(DataConfig(name="fashion-mnist", num_clients=4)).num_clients == 4
    from protofl.engine.spec import resolve_data

    assert resolve_data(DataConfig(name="fashion-mnist")).root == str(folder)
    assert resolve_data(DataConfig(name="mnist")).root is None  # others keep theirs
    monkeypatch.setitem(DATASETS, "fashion-mnist", replace(DATASETS["fashion-mnist"],
                                                           root=str(tmp_path / "absent")))
    with pytest.raises(ProtoflError, match="absent.*does not exist; run 'protofl data fetch "
                                           "fashion-mnist'"):
        load_dataset(DataConfig(name="fashion-mnist"))


def _published(monkeypatch, raw: dict[str, bytes]) -> None:
    """Make the tiny files the 'published' ones (sizes and MD5s of their content)."""
    monkeypatch.setattr(mnist, "FASHION_PUBLISHED", {
        s: (len(b), hashlib.md5(b).hexdigest()) for s, b in raw.items()})


def test_fetch_uses_the_installed_folder_when_its_files_check(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "usr-share"
    raw = write_fashion(folder)
    src = replace(SOURCES["fashion-mnist"], installed=(str(folder), "apt-get install x"))
    monkeypatch.setitem(SOURCES, "fashion-mnist", src)
    with pytest.raises(ProtoflError, match="installed files in .* do not check: .*"
                                           "not the published file.*reinstall them"):
        F.fetch("fashion-mnist", tmp_path / "data", progress=False)
    _published(monkeypatch, raw)
    assert main(["data", "fetch", "fashion-mnist", "--root", str(tmp_path / "data")]) == 0
    out = capsys.readouterr().out
    assert f"--set data.name=fashion-mnist --set data.root={folder}" in out
    assert not (tmp_path / "data").exists()  # nothing downloaded, nothing written


def test_fetch_downloads_where_the_package_is_absent(server, tmp_path, monkeypatch):
    raw = write_fashion(tmp_path / "src")
    files = []
    for fs in SOURCES["fashion-mnist"].files:  # the real table, served locally
        body = (tmp_path / "src" / fs.name).read_bytes()
        server.files[f"/{fs.name}"] = body
        files.append(replace(fs, urls=(f"{server.url}/{fs.name}",),
                             md5=hashlib.md5(body).hexdigest()))
    src = replace(SOURCES["fashion-mnist"], files=tuple(files),
                  installed=(str(tmp_path / "no-package"), "apt-get install pkg"))
    monkeypatch.setitem(SOURCES, "fashion-mnist", src)
    _published(monkeypatch, raw)
    root = F.fetch("fashion-mnist", tmp_path / "data", progress=False)
    assert load_dataset(DataConfig(name="fashion-mnist", root=str(root))).num_clients == 10
    # a failed download says how to get the files without one
    broken = replace(src, files=tuple(replace(f, urls=(f"{server.url}/missing",))
                                      for f in files))
    monkeypatch.setitem(SOURCES, "fashion-mnist", broken)
    with pytest.raises(ProtoflError, match="download of .* failed: .*; or install it where "
                                           "protofl reads it .*apt-get install pkg"):
        F.fetch("fashion-mnist", tmp_path / "data2", progress=False)


@pytest.mark.skipif(not DEBIAN.is_dir(), reason="Debian's dataset-fashion-mnist not installed")
def test_the_installed_debian_files_are_the_published_ones():
    from protofl.data.fetch_checks import fashion_mnist

    fashion_mnist(DEBIAN)  # their content has the published MD5s
    x, y, xt, yt = mnist.load_mnist(DEBIAN, "Fashion-MNIST", mnist.FASHION_PUBLISHED)
    assert x.shape == (60000, 28, 28) and xt.shape == (10000, 28, 28)
    assert np.bincount(y).tolist() == [6000] * 10 and np.bincount(yt).tolist() == [1000] * 10


def test_lenet5_layers_and_parameter_count():
    m = build_model("lenet5", (1, 28, 28), 10)
    # 28 -conv5-> 24 -pool-> 12 -conv5-> 8 -pool-> 4: 16 * 4 * 4 = 256 flattened
    by_hand = (1 * 6 * 25 + 6) + (6 * 16 * 25 + 16) + (256 * 120 + 120) + (120 * 84 + 84) + (
        84 * 10 + 10)
    assert by_hand == 44426 == sum(p.numel() for p in m.parameters())
    z, logits = m(torch.zeros(3, 1, 28, 28))
    assert z.shape == (3, 84) and logits.shape == (3, 10) and m.feature_dim == 84
    # 32x32 RGB (LeNet's classic CIFAR size): 16 * 5 * 5 = 400 flattened
    assert sum(p.numel() for p in build_model("lenet5", (3, 32, 32), 10).parameters()) == (
        3 * 6 * 25 + 6) + 2416 + (400 * 120 + 120) + 10164 + 850 == 62006
    with pytest.raises(ProtoflError, match="lenet5 needs image inputs"):
        build_model("lenet5", (60,), 10)


def test_cli_models_lists_parameter_counts(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert any(line.split()[:2] == ["lenet5", "44,426"] for line in out.splitlines())
    assert main(["models", "--input", "3,32,32"]) == 0
    assert "62,006" in capsys.readouterr().out
    assert main(["models", "--input", "3,x"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
