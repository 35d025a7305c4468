"""A Flower node's data are built once per machine and memory-mapped by its later messages
(each deployment message is a fresh process): data/store.py ``mapped``, flower/setup.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")

from sitefiles import write_site  # noqa: E402

from protofl.config import config_from_dict  # noqa: E402
from protofl.data import store  # noqa: E402
from protofl.flower import setup  # noqa: E402

CLASSES = ["a", "b"]


def site_config() -> str:
    return json.dumps(config_from_dict({
        "algorithm": "fedavg", "rounds": 1,
        "data": {"name": "site", "num_clients": 2, "classes": CLASSES,
                 "input_shape": [1, 8, 8]},
        "model": {"name": "mlp"}, "clients": {"per_round": 2}}).to_dict())


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(store.CACHE_ENV, str(tmp_path / "cache"))
    setup.build_site.cache_clear()
    setup.build_shared.cache_clear()
    yield tmp_path / "cache"
    setup.build_site.cache_clear()
    setup.build_shared.cache_clear()


def counting(monkeypatch) -> list:
    calls = []
    real = setup.site_data

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(setup, "site_data", spy)
    return calls


def test_a_site_decodes_its_files_once_and_maps_them_after(cache, tmp_path, monkeypatch):
    root = write_site(tmp_path / "site", {"a": 6, "b": 5}, CLASSES)
    calls = counting(monkeypatch)
    first = setup.build_site(site_config(), str(root), "", 1).fed.data
    setup.build_site.cache_clear()  # the next message: a new process, nothing in memory
    again = setup.build_site(site_config(), str(root), "", 1).fed.data
    assert len(calls) == 1  # the files were decoded once
    assert store.mapped_file(again.x_train) is not None
    assert str(cache) in store.mapped_file(again.x_train)
    for name in ("x_train", "y_train", "x_local_test", "y_local_test"):
        assert torch.equal(getattr(first, name), getattr(again, name))
    assert (again.train_offsets == first.train_offsets).all()
    assert again.class_names == first.class_names and again.scale == first.scale


def test_changed_files_or_another_site_or_no_cache_rebuild(cache, tmp_path, monkeypatch):
    root = write_site(tmp_path / "site", {"a": 6, "b": 5}, CLASSES)
    calls = counting(monkeypatch)
    setup.build_site(site_config(), str(root), "", 1)
    write_site(root, {"b": 7}, CLASSES, seed=5)  # the hospital adds images
    setup.build_site.cache_clear()
    grown = setup.build_site(site_config(), str(root), "", 1).fed.data
    assert len(calls) == 2 and grown.train_sizes.sum() + len(grown.y_local_test) == 13
    setup.build_site.cache_clear()
    setup.build_site(site_config(), str(root), "", 0)  # another partition of the same files
    assert len(calls) == 3
    setup.build_site.cache_clear()
    plain = setup.build_site(site_config(), str(root), "", 0, False).fed.data
    assert len(calls) == 4 and store.mapped_file(plain.x_train) is None


def test_a_shared_node_maps_the_dataset_another_process_built(cache):
    cfg = json.dumps(config_from_dict({"algorithm": "fedavg", "rounds": 1,
                                       "data": {"name": "digits", "num_clients": 4},
                                       "clients": {"per_round": 2}}).to_dict())
    code = ("import json, sys, torch; from protofl.flower import setup; "
            "d = setup.build_shared(sys.argv[1]).fed.data; "
            "print(json.dumps([float(d.x_train.double().sum()), len(d.y_train)]))")
    env = {**os.environ, store.CACHE_ENV: str(cache)}
    built = subprocess.run([sys.executable, "-c", code, cfg], env=env, capture_output=True,
                           text=True, check=True)
    folders = sorted(Path(cache).glob("node-*"))
    assert len(folders) == 1 and (folders[0] / store.META).is_file()
    here = setup.build_shared(cfg).fed.data  # this process maps what the other wrote
    assert store.mapped_file(here.x_train).startswith(str(folders[0]))
    assert json.loads(built.stdout) == [float(here.x_train.double().sum()), len(here.y_train)]
