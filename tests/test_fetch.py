"""protofl data fetch, offline: a local HTTP server (with Range support) on 127.0.0.1 serves
small archives the tests write."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import struct
import tarfile
import threading
import zipfile
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest

from protofl.cli import main
from protofl.config import DataConfig
from protofl.data import fetch as F
from protofl.data.registry import DATASETS, load_dataset
from protofl.data.sources import SOURCES, DataSource, FileSource
from protofl.errors import ProtoflError
from protofl.models.registry import MODELS


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        srv = self.server
        rng = self.headers.get("Range")
        srv.log.append((self.path, rng))
        body = srv.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        start = 0
        if rng and srv.ranges:
            start = int(re.match(r"bytes=(\d+)-", rng).group(1))
            if start >= len(body):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(body)}")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        chunk = body[start:]
        self.send_header("Content-Length", str(len(chunk)))
        self.end_headers()
        if srv.cuts.get(self.path, 0) > 0:  # send half, then hang up
            srv.cuts[self.path] -= 1
            self.wfile.write(chunk[: len(chunk) // 2])
            self.close_connection = True
            return
        self.wfile.write(chunk)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.files, srv.cuts, srv.log, srv.ranges = {}, {}, [], True
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def md5(b: bytes) -> str:
    return hashlib.md5(b).hexdigest()


def zip_bytes(files: dict[str, bytes], method=zipfile.ZIP_DEFLATED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buf.getvalue()


def add_source(monkeypatch, server, name: str, blobs: dict[str, bytes], *, unpack=True,
               checksums: dict[str, str] | None = None, **kw) -> DataSource:
    files = []
    for fname, data in blobs.items():
        server.files[f"/{fname}"] = data
        files.append(FileSource(fname, (f"{server.url}/{fname}",),
                                md5=(checksums or {}).get(fname, md5(data)), unpack=unpack))
    src = DataSource(name, "mnist", "test source", tuple(files), "1 KB", **kw)
    monkeypatch.setitem(SOURCES, name, src)
    return src


def nothing_complete(root: Path, name: str) -> None:
    assert not (root / name).exists()
    assert not list(root.glob(f".{name}.partial-*"))
    downloads = root / f".{name}.downloads"
    assert not downloads.exists() or all(p.suffix == ".part" for p in downloads.iterdir())


def test_good_download_unpacks_atomically(server, monkeypatch, tmp_path):
    archive = zip_bytes({"inner/a.txt": b"alpha", "inner/b.txt": b"beta" * 1000})
    add_source(monkeypatch, server, "tiny", {"tiny.zip": archive})
    root = F.fetch("tiny", tmp_path, progress=False)
    assert root == tmp_path.resolve() / "tiny"
    assert (root / "inner" / "b.txt").read_bytes() == b"beta" * 1000
    marker = json.loads((root / F.MARKER).read_text())
    assert marker["files"][0]["checksum"] == ["md5", md5(archive)]
    assert not (tmp_path / ".tiny.downloads").exists() and not list(tmp_path.glob(".tiny.*"))
    n = len(server.log)
    assert F.fetch("tiny", tmp_path, progress=False) == root and len(server.log) == n  # idempotent


def test_checksum_mismatch_leaves_nothing_complete(server, monkeypatch, tmp_path):
    add_source(monkeypatch, server, "bad", {"bad.zip": zip_bytes({"a": b"x"})},
               checksums={"bad.zip": "0" * 32})
    with pytest.raises(ProtoflError, match=r"MD5 checksum mismatch: expected 0{32}, got"):
        F.fetch("bad", tmp_path, progress=False)
    nothing_complete(tmp_path, "bad")
    assert not list((tmp_path / ".bad.downloads").iterdir())  # the bad file was deleted


def test_download_cut_halfway_is_resumed(server, monkeypatch, tmp_path):
    data = bytes(range(256)) * 400
    add_source(monkeypatch, server, "cut", {"cut.bin": data}, unpack=False)
    server.cuts["/cut.bin"] = 1
    root = F.fetch("cut", tmp_path, progress=False, pause=0)
    assert (root / "cut.bin").read_bytes() == data
    assert server.log == [("/cut.bin", None), ("/cut.bin", f"bytes={len(data) // 2}-")]


def test_broken_download_resumes_on_the_next_run(server, monkeypatch, tmp_path):
    data = b"0123456789" * 3000
    add_source(monkeypatch, server, "later", {"later.bin": data}, unpack=False)
    server.cuts["/later.bin"] = 1
    with pytest.raises(ProtoflError, match="connection closed after 15000 of 30000 bytes; run "
                                           "the same command again to resume"):
        F.fetch("later", tmp_path, progress=False, attempts=1)
    nothing_complete(tmp_path, "later")
    assert (tmp_path / ".later.downloads" / "later.bin.part").stat().st_size == 15000
    root = F.fetch("later", tmp_path, progress=False, attempts=1)
    assert (root / "later.bin").read_bytes() == data
    assert server.log[-1] == ("/later.bin", "bytes=15000-")


def test_server_ignoring_range_restarts_from_zero(server, monkeypatch, tmp_path):
    data = b"abc" * 5000
    add_source(monkeypatch, server, "norange", {"n.bin": data}, unpack=False)
    server.ranges = False
    part = tmp_path / ".norange.downloads" / "n.bin.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"junk")  # would corrupt the file if appended to
    root = F.fetch("norange", tmp_path, progress=False)
    assert (root / "n.bin").read_bytes() == data


def test_corrupt_archive_is_refused_and_deleted(server, monkeypatch, tmp_path):
    good = zip_bytes({"a.txt": b"A" * 4000}, zipfile.ZIP_STORED)
    i = good.index(b"A" * 100)
    bad = good[:i] + b"B" + good[i + 1:]  # CRC no longer matches; checksum of the bad bytes
    add_source(monkeypatch, server, "corrupt", {"c.zip": bad})
    with pytest.raises(ProtoflError, match="archive c.zip is corrupt.*the download was deleted"):
        F.fetch("corrupt", tmp_path, progress=False)
    nothing_complete(tmp_path, "corrupt")
    assert not (tmp_path / ".corrupt.downloads" / "c.zip").exists()


def test_truncated_archive_is_refused(server, monkeypatch, tmp_path):
    noise = np.random.default_rng(0).bytes(5000)
    add_source(monkeypatch, server, "trunc", {"t.zip": zip_bytes({"a": noise})[:2000]})
    with pytest.raises(ProtoflError, match="neither a zip nor a tar"):
        F.fetch("trunc", tmp_path, progress=False)
    nothing_complete(tmp_path, "trunc")


def test_http_error_falls_back_to_the_mirror_then_fails_clearly(server, monkeypatch, tmp_path):
    data = b"mirror"
    server.files["/m/f.bin"] = data
    fs = FileSource("f.bin", (f"{server.url}/gone/f.bin", f"{server.url}/m/f.bin"), md5=md5(data))
    monkeypatch.setitem(SOURCES, "mir", DataSource("mir", "mnist", "t", (fs,)))
    assert (F.fetch("mir", tmp_path, progress=False) / "f.bin").read_bytes() == data
    fs404 = replace(fs, urls=(f"{server.url}/gone/f.bin",))
    monkeypatch.setitem(SOURCES, "gone", DataSource("gone", "mnist", "t", (fs404,)))
    with pytest.raises(ProtoflError, match=r"download of f.bin failed: .*/gone/f.bin: HTTP 404"):
        F.fetch("gone", tmp_path, progress=False)
    nothing_complete(tmp_path, "gone")


def test_no_space_is_one_clear_error(server, monkeypatch, tmp_path):
    fs = FileSource("huge.bin", (f"{server.url}/huge.bin",), md5="0" * 32, size=10**18)
    monkeypatch.setitem(SOURCES, "huge", DataSource("huge", "mnist", "t", (fs,)))
    with pytest.raises(ProtoflError, match="no space left on the device .* needed"):
        F.fetch("huge", tmp_path, progress=False)
    assert server.log == []  # refused before downloading
    nothing_complete(tmp_path, "huge")


def test_tar_archive_and_path_traversal(tmp_path):
    def tar(members: dict[str, bytes]) -> Path:
        path = tmp_path / f"t{len(list(tmp_path.iterdir()))}.tar.gz"
        with tarfile.open(path, "w:gz") as t:
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
        return path

    F.unpack(tar({"d/x.txt": b"x"}), tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "d" / "x.txt").read_bytes() == b"x"
    with pytest.raises(ProtoflError, match="outside"):
        F.unpack(tar({"../evil.txt": b"x"}), tmp_path / "out2", progress=False)
    assert not (tmp_path / "evil.txt").exists()


def test_existing_unmarked_folder_is_not_overwritten(server, monkeypatch, tmp_path):
    add_source(monkeypatch, server, "mine", {"m.zip": zip_bytes({"a": b"1"})})
    (tmp_path / "mine").mkdir()
    with pytest.raises(ProtoflError, match="exists but is not a finished fetch"):
        F.fetch("mine", tmp_path, progress=False)


# ---------------------------------------------------------------- real layouts
def idx_gz(arr: np.ndarray) -> bytes:
    code = 0x08
    head = struct.pack(">HBB", 0, code, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return gzip.compress(head + arr.astype(np.uint8).tobytes())


def test_mnist_fetch_prints_a_root_the_loader_reads(server, monkeypatch, tmp_path, capsys):
    rng = np.random.default_rng(0)
    arrays = {"train-images-idx3-ubyte.gz": rng.integers(0, 256, (40, 28, 28)),
              "train-labels-idx1-ubyte.gz": np.arange(40) % 10,
              "t10k-images-idx3-ubyte.gz": rng.integers(0, 256, (10, 28, 28)),
              "t10k-labels-idx1-ubyte.gz": np.arange(10)}
    files = []
    for fs in SOURCES["mnist"].files:  # the real table, served locally
        data = idx_gz(arrays[fs.name])
        server.files[f"/{fs.name}"] = data
        files.append(replace(fs, urls=(f"{server.url}/{fs.name}",), md5=md5(data), size=None))
    monkeypatch.setitem(SOURCES, "mnist", replace(SOURCES["mnist"], files=tuple(files)))
    assert main(["data", "fetch", "mnist", "--root", str(tmp_path), "-q"]) == 0
    out = capsys.readouterr().out
    root = re.search(r"data.root=(\S+)", out).group(1)
    assert "--set data.name=mnist" in out
    data = load_dataset(DataConfig(name="mnist", root=root, num_clients=4,
                                   classes_per_client=2))
    assert data.num_clients == 4 and len(data.x_test) == 10


def test_medmnist_fetch_root_loads(server, monkeypatch, tmp_path):
    buf = io.BytesIO()
    rng = np.random.default_rng(1)
    np.savez(buf, train_images=rng.integers(0, 256, (30, 8, 8, 3), dtype=np.uint8),
             train_labels=(np.arange(30) % 3)[:, None], val_images=np.zeros((0, 8, 8, 3),
             np.uint8), val_labels=np.zeros((0, 1)), test_images=rng.integers(
             0, 256, (6, 8, 8, 3), dtype=np.uint8), test_labels=(np.arange(6) % 3)[:, None])
    data = buf.getvalue()
    fs = SOURCES["dermamnist_64"].files[0]
    server.files["/d.npz"] = data
    monkeypatch.setitem(SOURCES, "dermamnist_64", replace(
        SOURCES["dermamnist_64"], files=(replace(fs, urls=(f"{server.url}/d.npz",),
                                                 md5=md5(data)),)))
    root = F.fetch("dermamnist_64", tmp_path, progress=False)
    fed = load_dataset(DataConfig(name="medmnist", root=str(root), num_clients=3))
    assert fed.name == "dermamnist_64" and fed.input_shape == (3, 8, 8)


def test_dataverse_source_end_to_end(server, monkeypatch, tmp_path):
    """HAM10000's way: ids, sizes and MD5s from a Dataverse record; the metadata table in its
    original format; the result loads with the ham10000 loader."""
    from test_loaders_medical import write_ham

    src_dir = tmp_path / "src"
    write_ham(src_dir, n_lesions=14)
    zips = {p: zip_bytes({f.name: f.read_bytes() for f in (src_dir / p).iterdir()})
            for p in ("HAM10000_images_part_1", "HAM10000_images_part_2")}
    meta = (src_dir / "HAM10000_metadata.csv").read_bytes()
    record = {"data": {"latestVersion": {"files": [
        {"dataFile": {"id": 11, "filename": "HAM10000_images_part_1.zip",
                      "filesize": len(zips["HAM10000_images_part_1"]),
                      "checksum": {"type": "MD5", "value": md5(zips["HAM10000_images_part_1"])}}},
        {"dataFile": {"id": 12, "filename": "HAM10000_images_part_2.zip",
                      "md5": md5(zips["HAM10000_images_part_2"])}},
        {"dataFile": {"id": 13, "filename": "HAM10000_metadata.tab",
                      "originalFileFormat": "text/csv", "originalFileSize": len(meta),
                      "checksum": {"type": "MD5", "value": md5(meta)}}}]}}}
    doi = "doi:10.0000/TEST"
    server.files[f"/api/datasets/:persistentId/?persistentId={doi}"] = json.dumps(record).encode()
    server.files["/api/access/datafile/11"] = zips["HAM10000_images_part_1"]
    server.files["/api/access/datafile/12"] = zips["HAM10000_images_part_2"]
    server.files["/api/access/datafile/13?format=original"] = meta
    ham = SOURCES["ham10000"]
    monkeypatch.setitem(SOURCES, "ham10000", replace(
        ham, dataverse=(server.url, doi, ham.dataverse[2])))
    root = F.fetch("ham10000", tmp_path / "data", progress=False)
    assert (root / "HAM10000_metadata.csv").read_bytes() == meta
    fed = load_dataset(DataConfig(name="ham10000", root=str(root), num_clients=2,
                                  image_size=8))
    assert fed.num_classes == 7 and fed.input_shape == (3, 8, 8)


def test_dataverse_record_without_the_file(server, monkeypatch, tmp_path):
    doi = "doi:10.0000/EMPTY"
    server.files[f"/api/datasets/:persistentId/?persistentId={doi}"] = json.dumps(
        {"data": {"latestVersion": {"files": []}}}).encode()
    with pytest.raises(ProtoflError, match="has no file 'x.zip'"):
        F.resolve_dataverse(server.url, doi, (("x.zip", True, ""),))


# ---------------------------------------------------------------- table, messages, CLI
def test_source_table_is_well_formed():
    import importlib

    for name, s in SOURCES.items():
        assert s.name == name and (s.dataset in DATASETS) != bool(s.model), name
        assert s.manual or s.files or s.dataverse, name
        assert not (s.manual and s.files), name
        for f in s.files:
            assert f.checksum is not None, f.name  # every downloaded file is verified
            algorithm, digest = f.checksum
            n = 32 if algorithm == "md5" else 8 if f.sha256_prefix else 64
            assert re.fullmatch(f"[0-9a-f]{{{n}}}", digest)
            if f.sha256_prefix:  # torch.hub's naming: the prefix is in the file name
                assert f.name.endswith(f"-{digest}.pth") and s.model in MODELS
            assert f.checksum_from
            for url in f.urls:
                u = urlparse(url)
                assert u.scheme in ("http", "https") and u.netloc and u.path.strip("/"), url
        if s.dataverse:
            assert s.dataverse[0].startswith("https://") and s.dataverse[1].startswith("doi:")
        for spec in (s.prepare, s.check):
            if spec:
                module, func = spec.split(":")
                assert callable(getattr(importlib.import_module(module), func)), spec
    digests = [f.checksum[1] for s in SOURCES.values() for f in s.files]
    assert len(digests) == len(set(digests))  # no checksum pasted twice
    assert {f"{b}{s}" for b in ("dermamnist", "bloodmnist")
            for s in ("", "_64", "_128", "_224")} <= set(SOURCES)


def test_manual_source_prints_where_to_get_it(tmp_path, capsys):
    assert main(["data", "fetch", "matek19", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cancerimagingarchive" in err
    assert str(tmp_path / "matek19") in err


def test_missing_root_names_the_fetch_command(tmp_path):
    with pytest.raises(ProtoflError, match="run 'protofl data fetch mnist' to download it"):
        load_dataset(DataConfig(name="mnist"))
    with pytest.raises(ProtoflError, match=r"does not exist; run 'protofl data fetch NAME' "
                                           r"\(NAME: dermamnist, "):
        load_dataset(DataConfig(name="medmnist", root=str(tmp_path / "nope")))
    for name in ("voc_macro", "voc_seg", "voc_seg_macro"):  # the VOC tree's other readings
        with pytest.raises(ProtoflError, match="data fetch voc"):
            load_dataset(DataConfig(name=name))


def test_cli_data_list(capsys, tmp_path):
    assert main(["data", "list", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in ("mnist", "voc", "dermamnist_224", "bloodmnist_64", "ham10000", "femnist",
                 "celeba", "matek19"):
        assert re.search(rf"^{name}\s", out, re.M), name
    # every source says where its checksums come from
    notes = re.findall(r"^\s+checksums: (.+)$", out, re.M)
    assert len(notes) == len(SOURCES) and all(notes)
    assert "torchvision's MNIST" in notes[0] and "doi:10.7910/DVN/DBW86T" in out
    assert main(["data", "fetch", "nope", "--root", str(tmp_path)]) == 2


def test_celeba_by_hand_then_fetch_writes_the_json(tmp_path, capsys):
    from PIL import Image
    from test_leaf_prep import write_celeba

    raw = tmp_path / "celeba" / "raw"
    write_celeba(raw)
    for i in range(15):
        Image.fromarray(np.full((10, 8, 3), i * 9, np.uint8)).save(
            raw / "img_align_celeba" / f"{i:06d}.jpg")
    assert main(["data", "fetch", "celeba", "--root", str(tmp_path), "-q"]) == 0
    root = re.search(r"data.root=(\S+)", capsys.readouterr().out).group(1)
    assert F.is_complete(Path(root))
    fed = load_dataset(DataConfig(name="celeba", root=root, image_size=8))
    assert fed.num_clients == 2 and fed.num_classes == 2


# ---------------------------------------------------------------- CIFAR-10/100, Tiny-ImageNet
def _tar_gz(folder: Path, top: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        t.add(folder, arcname=top)
    return buf.getvalue()


def _serve_real(server, monkeypatch, name: str, data: bytes) -> None:
    """The real table entry of ``name`` with its URL pointed at the local server and the
    MD5 of ``data`` (its file name, unpacking and layout check stay as they are)."""
    fs = SOURCES[name].files[0]
    server.files[f"/{fs.name}"] = data
    monkeypatch.setitem(SOURCES, name, replace(SOURCES[name], files=(replace(
        fs, urls=(f"{server.url}/{fs.name}",), md5=md5(data), size=None),)))


def test_published_checksums_of_the_image_benchmarks():
    want = {"cifar10": ("cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a",
                        "https://www.cs.toronto.edu/~kriz/"),
            "cifar100": ("cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85",
                         "https://www.cs.toronto.edu/~kriz/"),
            "tinyimagenet": ("tiny-imagenet-200.zip", "90528d7ca1a48142e341f4ef8d21d0de",
                             "https://cs231n.stanford.edu/")}
    for name, (fname, digest, host) in want.items():
        (fs,) = SOURCES[name].files
        assert (fs.name, fs.checksum, fs.urls[0]) == (fname, ("md5", digest), host + fname)
        assert fs.unpack and SOURCES[name].dataset == name


def test_cifar10_fetch_resumes_and_prints_a_root_the_loader_reads(server, monkeypatch,
                                                                  tmp_path, capsys):
    from test_cifar import write_cifar10

    write_cifar10(tmp_path / "src", per_batch=20)
    _serve_real(server, monkeypatch, "cifar10", _tar_gz(tmp_path / "src", "cifar-10-batches-py"))
    server.cuts["/cifar-10-python.tar.gz"] = 1  # the first connection breaks halfway
    monkeypatch.setattr(F.time, "sleep", lambda s: None)
    assert main(["data", "fetch", "cifar10", "--root", str(tmp_path / "d"), "-q"]) == 0
    assert [r for _, r in server.log][1].startswith("bytes=")  # resumed, not restarted
    out = capsys.readouterr().out
    root = re.search(r"data.root=(\S+)", out).group(1)
    assert root.endswith("cifar10/cifar-10-batches-py") and "data.name=cifar10" in out
    fed = load_dataset(DataConfig(name="cifar10", root=root, num_clients=4, alpha=1.0))
    assert fed.num_classes == 10 and fed.input_shape == (3, 32, 32) and len(fed.y_test) == 10


def test_cifar100_fetch_root_loads(server, monkeypatch, tmp_path):
    from test_cifar import write_cifar100

    write_cifar100(tmp_path / "src")
    _serve_real(server, monkeypatch, "cifar100", _tar_gz(tmp_path / "src", "cifar-100-python"))
    root = F.fetch("cifar100", tmp_path / "d", progress=False)
    assert root.name == "cifar-100-python" and F.is_complete(root.parent)
    fed = load_dataset(DataConfig(name="cifar100", root=str(root), num_clients=2,
                                  partition="iid"))
    assert fed.num_classes == 100 and fed.class_names[3] == "c3"


def test_cifar_archive_without_a_batch_is_refused(server, monkeypatch, tmp_path):
    from test_cifar import write_cifar10

    write_cifar10(tmp_path / "src")
    (tmp_path / "src" / "data_batch_5").unlink()
    _serve_real(server, monkeypatch, "cifar10", _tar_gz(tmp_path / "src", "cifar-10-batches-py"))
    with pytest.raises(ProtoflError, match="not in the layout the cifar10 loader reads: .*"
                                           "lacks data_batch_5"):
        F.fetch("cifar10", tmp_path / "d", progress=False)
    assert not (tmp_path / "d" / "cifar10").exists()  # nothing that looks complete
    assert not list((tmp_path / "d").glob(".cifar10.partial-*"))


def test_tinyimagenet_fetch_root_loads(server, monkeypatch, tmp_path):
    from test_cifar import write_tiny

    top = write_tiny(tmp_path / "src", side=16)
    files = {str(p.relative_to(top.parent)): p.read_bytes() for p in top.rglob("*")
             if p.is_file()}
    _serve_real(server, monkeypatch, "tinyimagenet", zip_bytes(files))
    root = F.fetch("tinyimagenet", tmp_path / "d", progress=False)
    assert root.name == "tiny-imagenet-200" and (root / "test" / "images").is_dir()
    fed = load_dataset(DataConfig(name="tinyimagenet", root=str(root), num_clients=2,
                                  alpha=1.0, image_size=16))
    assert fed.num_classes == 3 and len(fed.y_test) == 6


# ---------------------------------------------------------------- pretrained weights
def serve_weights(monkeypatch, server, name: str, blob: bytes, prefix: str | None = None):
    """Source ``name`` (the real table entry) served locally, with the SHA-256 prefix of
    ``blob`` (or ``prefix``)."""
    fs = SOURCES[name].files[0]
    server.files[f"/{fs.name}"] = blob
    digest = prefix or hashlib.sha256(blob).hexdigest()[:8]
    monkeypatch.setitem(SOURCES, name, replace(SOURCES[name], files=(
        replace(fs, urls=(f"{server.url}/{fs.name}",), sha256_prefix=digest),)))
    return fs


def saved(sd: dict) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(sd, buf)
    return buf.getvalue()


def test_mobilenet_v2_weights_fetch_and_load(server, monkeypatch, tmp_path, capsys):
    """The fetched file is the path printed for model.pretrained; a cut download resumes;
    DeepLab's encoder loads it with its BatchNorm statistics."""
    import torch
    from test_deeplab import torchvision_mobilenet_v2_state

    from protofl.config import ModelConfig
    from protofl.models.deeplab import deeplabv3plus

    sd = torchvision_mobilenet_v2_state(width=0.35)
    fs = serve_weights(monkeypatch, server, "mobilenet_v2", saved(sd))
    server.cuts[f"/{fs.name}"] = 1
    assert main(["data", "fetch", "mobilenet_v2", "--root", str(tmp_path), "-q"]) == 0
    out = capsys.readouterr().out
    path = re.search(r"model.pretrained=(\S+)", out).group(1)
    assert "model.name=deeplabv3plus" in out and path.endswith("mobilenet_v2-b0353104.pth")
    assert [r for _, r in server.log] == [None, f"bytes={len(saved(sd)) // 2}-"]
    m = deeplabv3plus((3, 32, 32), 4, ModelConfig(norm="frozen", pretrained=path),
                      width=0.35, channels=16)
    assert torch.equal(m.encoder.features[5].conv[1][1].running_var,
                       sd["features.5.conv.1.1.running_var"])
    assert F.fetch("mobilenet_v2", tmp_path, progress=False) == Path(path)  # idempotent
    assert re.search(r"^mobilenet_v2\s+-\s.*\[fetched\]", "\n".join(
        F.list_sources(tmp_path)), re.M)


def test_weights_checksum_mismatch_and_wrong_file_are_refused(server, monkeypatch, tmp_path):
    import torch
    from test_resnet import torchvision_resnet18_state

    good = saved(torchvision_resnet18_state(num_classes=3))
    serve_weights(monkeypatch, server, "resnet18", good, prefix="f37072fd")
    with pytest.raises(ProtoflError, match="SHA256 checksum mismatch: expected f37072fd... "
                                           r"\(a published prefix\), got"):
        F.fetch("resnet18", tmp_path, progress=False)
    nothing_complete(tmp_path, "resnet18")
    not_resnet = saved({"conv1.weight": torch.zeros(1)})
    serve_weights(monkeypatch, server, "resnet18", not_resnet)
    with pytest.raises(ProtoflError, match="the fetched files are not in the layout the "
                                           "resnet18 loader reads: .*not a torchvision ResNet"):
        F.fetch("resnet18", tmp_path, progress=False)
    assert not (tmp_path / "resnet18").exists()  # verified download kept, nothing complete
    serve_weights(monkeypatch, server, "resnet18", good)
    path = F.fetch("resnet18", tmp_path, progress=False)
    assert path.name == "resnet18-f37072fd.pth" and F.is_complete(path.parent)
