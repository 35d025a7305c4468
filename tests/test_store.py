"""Lean storage: source-dtype rows, ``FederatedData.inputs``, and the memory-mapped cache."""

import json

import numpy as np
import pytest
import torch
from test_loaders_mnist import write_mnist

from protofl.config import DataConfig
from protofl.data import cache as cache_mod
from protofl.data import registry, store
from protofl.data.federated import from_partition
from protofl.data.registry import load_dataset

SPLITS = ("x_train", "x_local_test", "x_test")


def test_inputs_divides_integer_rows_and_passes_floats():
    x = torch.arange(256, dtype=torch.uint8).reshape(4, 1, 8, 8)
    parts = [np.arange(0, 2), np.arange(2, 4)]
    data = from_partition("t", 2, x, torch.tensor([0, 1, 0, 1]), parts, scale=255.0,
                          local_test_fraction=0.0)
    got = data.inputs(data.x_train)
    want = np.arange(256, dtype=np.uint8).astype(np.float32).reshape(4, 1, 8, 8) / 255.0
    assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(want))
    assert data.inputs(data.x_train, torch.float64).dtype == torch.float64
    floats = data.inputs(data.x_train)
    assert data.inputs(floats) is floats  # already model inputs
    dec = data.decoded()
    assert dec.scale is None and torch.equal(dec.x_train, got)
    assert data.nbytes == 256 and dec.nbytes == 4 * 256


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(store.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _mnist(tmp_path):
    root = tmp_path / "mnist"
    root.mkdir()
    write_mnist(root, n_train=200, n_test=40)
    return DataConfig(name="mnist", root=str(root), num_clients=5)


def _same(a, b):
    for name in SPLITS:
        assert torch.equal(a.inputs(getattr(a, name)), b.inputs(getattr(b, name))), name
    for name in ("y_train", "y_local_test", "y_test"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert np.array_equal(a.train_offsets, b.train_offsets)
    assert np.array_equal(a.test_offsets, b.test_offsets)


def test_lean_within_budget_stays_in_memory(tmp_path, cache):
    cfg = _mnist(tmp_path)
    lean, full = load_dataset(cfg, lean=True), load_dataset(cfg)
    assert lean.x_train.dtype == torch.uint8 and full.x_train.dtype == torch.float32
    assert full.nbytes == 4 * lean.nbytes
    _same(lean, full)
    assert not cache.exists()  # nothing spilled, nothing cached


def test_over_budget_maps_from_disk_and_reuses_the_cache(tmp_path, cache, monkeypatch):
    cfg = _mnist(tmp_path)
    monkeypatch.setenv(store.BUDGET_ENV, "0.01")  # 10 KiB: the split must go to disk
    data = load_dataset(cfg, lean=True)
    [folder] = list(cache.iterdir())
    assert {p.name for p in folder.iterdir()} == {f"{s}.npy" for s in SPLITS} | {
        store.META, store.LABELS}
    assert store.mapped_file(data.x_train).endswith("x_train.npy")
    assert store.mapped_file(load_dataset(cfg).x_train) is None
    _same(data, load_dataset(cfg))

    def no_build(_cfg):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(registry, "importlib", _Importer(no_build))
    again = load_dataset(cfg, lean=True)
    assert store.mapped_file(again.x_train).endswith("x_train.npy")
    _same(again, data)
    monkeypatch.undo()
    # a changed data file gives a new cache entry
    monkeypatch.setenv(store.CACHE_ENV, str(cache))
    monkeypatch.setenv(store.BUDGET_ENV, "0.01")
    write_mnist(tmp_path / "mnist", n_train=200, n_test=40, seed=1)
    load_dataset(cfg, lean=True)
    assert len(list(cache.iterdir())) == 2


class _Importer:
    """Stands in for importlib in the registry: every builder is ``fn``."""

    def __init__(self, fn):
        self.fn = fn

    def import_module(self, _name):
        return self

    def __getattr__(self, _name):
        return self.fn


def test_shared_global_test_is_cached_once(tmp_path, cache, monkeypatch):
    """LEAF with train/ and test/: the global test set is the local test splits' union."""
    doc = {"users": ["u1", "u2"], "num_samples": [3, 2],
           "user_data": {"u1": {"x": [[0.0, 1.0]] * 3, "y": [0, 1, 1]},
                         "u2": {"x": [[2.0, 3.0]] * 2, "y": [1, 0]}}}
    test = {"users": ["u1", "u2"], "num_samples": [1, 1],
            "user_data": {"u1": {"x": [[5.0, 5.0]], "y": [1]},
                          "u2": {"x": [[6.0, 6.0]], "y": [0]}}}
    for split, d in (("train", doc), ("test", test)):
        (tmp_path / split).mkdir()
        (tmp_path / split / "a.json").write_text(json.dumps(d))
    monkeypatch.setenv(store.BUDGET_ENV, "0")
    cfg = DataConfig(name="leaf", root=str(tmp_path))
    first = load_dataset(cfg, lean=True)
    again = load_dataset(cfg, lean=True)
    assert again.x_test is again.x_local_test
    assert again.x_test[:, 0].tolist() == [5.0, 6.0]
    _same(first, again)


def test_images_decode_straight_into_the_mapped_cache(tmp_path, cache, monkeypatch):
    from test_loaders_medical import write_matek

    write_matek(tmp_path / "matek")
    cfg = DataConfig(name="matek19", root=str(tmp_path / "matek"), num_clients=2, image_size=8,
                     partition="iid")
    monkeypatch.setenv(store.BUDGET_ENV, "0")
    data = load_dataset(cfg, lean=True)
    assert data.x_train.dtype == torch.uint8 and data.scale == 255.0
    assert store.mapped_file(data.x_test).endswith("x_test.npy")
    _same(data, load_dataset(cfg))


def test_a_build_that_loses_the_race_maps_the_published_cache(tmp_path, cache, monkeypatch):
    """Two processes building the same cache: each writes its own folder; the second to
    finish finds the first's published and uses it."""
    cfg = _mnist(tmp_path)
    monkeypatch.setenv(store.BUDGET_ENV, "0")
    first = load_dataset(cfg, lean=True)
    [folder] = list(cache.iterdir())
    monkeypatch.setattr(cache_mod, "load_cached", _once_none(cache_mod.load_cached))
    second = load_dataset(cfg, lean=True)  # built again: the check "saw" no cache
    assert [p.name for p in cache.iterdir()] == [folder.name]  # its own folder is gone
    assert store.mapped_file(second.x_train) == str(folder / "x_train.npy")
    _same(first, second)


def _once_none(fn):
    calls = []

    def wrapped(folder):
        calls.append(folder)
        return None if len(calls) == 1 else fn(folder)

    return wrapped
