"""Site mode without Flower: the image-folder loader, what a site loads and is refused for, the
server's view, the skipped metrics, and the federated evaluation figures."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from sitefiles import write_site

from protofl.api import run_experiment
from protofl.config import DataConfig, config_from_dict
from protofl.data.registry import load_dataset
from protofl.data.site import SiteFederation, agreement, label_map, server_federation, site_data
from protofl.engine.experiment import Experiment
from protofl.engine.train import SequentialTrainer
from protofl.errors import ProtoflError
from protofl.metrics.classification import confusion, report
from protofl.metrics.sites import SiteScore, pooled_figures, score_split

ABC = ["a", "b", "c"]


def site_cfg(**kw) -> DataConfig:
    base = {"name": "site", "num_clients": 3, "classes": ABC, "input_shape": [1, 8, 8]}
    return DataConfig(**{**base, **kw})


# ---- the image-folder loader ----

def test_imagefolder_classes_split_and_partition(tmp_path):
    write_site(tmp_path, {"b": 10, "a": 15, "c": 5}, ABC)
    fed = load_dataset(DataConfig(name="imagefolder", root=str(tmp_path), num_clients=2,
                                  partition="iid"))
    assert fed.class_names == ABC and fed.num_classes == 3  # sorted folder names
    assert fed.input_shape == (1, 8, 8)  # grey PNGs: one channel
    # a stratified 20% of each class is the global test set: 3 + 2 + 1
    assert np.bincount(fed.y_test.numpy(), minlength=3).tolist() == [3, 2, 1]
    assert fed.num_clients == 2 and len(fed.y_train) + len(fed.y_local_test) == 24
    # the band of class k is at row 2k: labels follow the folder, not the file order
    x = torch.cat([fed.x_train, fed.x_test])
    y = torch.cat([fed.y_train, fed.y_test])
    assert all(float(x[i, 0, 2 * int(y[i])].mean()) > 0.8 for i in range(len(y)))


def test_imagefolder_train_test_layout_and_modes(tmp_path):
    write_site(tmp_path, {"a": 4, "b": 4}, ABC, mode="RGB", test={"a": 2, "b": 1})
    cfg = DataConfig(name="imagefolder", root=str(tmp_path), num_clients=1, partition="iid")
    fed = load_dataset(cfg)
    assert fed.input_shape == (3, 8, 8) and fed.y_test.tolist() == [0, 0, 1]
    assert load_dataset(dataclasses.replace(cfg, input_shape=[1, 8, 8])).input_shape == (1, 8, 8)
    assert load_dataset(dataclasses.replace(cfg, image_size=4)).input_shape == (3, 4, 4)
    write_site(tmp_path, {}, ABC, test={"c": 1})  # a test class the training folder lacks
    with pytest.raises(ProtoflError, match="'c' is not one of a, b"):
        load_dataset(cfg)


def test_imagefolder_refuses_empty_and_missing(tmp_path):
    (tmp_path / "a").mkdir()
    with pytest.raises(ProtoflError, match="holds no images"):
        load_dataset(DataConfig(name="imagefolder", root=str(tmp_path)))
    (tmp_path / "f.png").write_bytes(b"")
    with pytest.raises(ProtoflError, match="not a folder"):
        load_dataset(DataConfig(name="imagefolder", root=str(tmp_path / "f.png")))


# ---- the agreement and what a site loads ----

@pytest.mark.parametrize("kw, match", [
    ({"num_clients": None}, "data.num_clients"),
    ({"classes": []}, "data.classes .* or data.num_classes"),
    ({"classes": ["a", "a"]}, "twice"),
    ({"num_classes": 2}, "num_classes = 2 but data.classes names 3"),
    ({"input_shape": []}, "data.input_shape"),
    ({"input_shape": [1, 0, 8]}, "data.input_shape"),
])
def test_agreement_errors(kw, match):
    with pytest.raises(ProtoflError, match=match):
        agreement(site_cfg(**kw))


def test_agreement_unnamed_classes():
    ag = agreement(site_cfg(classes=[], num_classes=4))
    assert ag.classes == ["0", "1", "2", "3"] and ag.input_shape == (1, 8, 8) and ag.sites == 3


def test_site_data_maps_classes_by_name_and_holds_only_its_rows(tmp_path):
    write_site(tmp_path, {"c": 5, "a": 10}, ABC)  # no class b at this site
    fed = site_data(site_cfg(), "imagefolder", str(tmp_path), 1)
    assert fed.num_clients == 3 and fed.num_classes == 3 and fed.class_names == ABC
    assert fed.train_sizes.tolist() == [0, 12, 0]  # 20% held out: 2 of a, 1 of c
    x, y = fed.client_train(1)
    assert x.dtype == torch.uint8 and fed.scale == 255.0  # pixels as stored
    assert sorted(set(y.tolist())) == [0, 2]  # c keeps the agreed index 2, not its rank 1
    x = fed.inputs(x)
    assert all(float(x[i, 0, 2 * int(y[i])].mean()) > 0.8 for i in range(len(y)))
    assert sorted(fed.client_test(1)[1].tolist()) == [0, 0, 2]
    assert len(fed.client_test(0)[1]) == 0


def test_site_with_another_class_or_shape_is_refused(tmp_path):
    write_site(tmp_path / "odd", {"a": 3, "zebra": 2}, ABC)
    with pytest.raises(ProtoflError, match=r"site 0 .*class 'zebra' \(2 samples\), not one of"):
        site_data(site_cfg(), "imagefolder", str(tmp_path / "odd"), 0)
    write_site(tmp_path / "big", {"a": 3, "b": 3}, ABC, size=16)
    with pytest.raises(ProtoflError, match=r"samples are \(1, 16, 16\).*\[1, 8, 8\]"):
        site_data(site_cfg(), "imagefolder", str(tmp_path / "big"), 0)
    fed = site_data(site_cfg(image_size=8), "imagefolder", str(tmp_path / "big"), 0)
    assert fed.input_shape == (1, 8, 8)  # data.image_size in the run config resizes
    with pytest.raises(ProtoflError, match="outside 0..2"):
        site_data(site_cfg(), "imagefolder", str(tmp_path / "big"), 3)
    with pytest.raises(ProtoflError, match="no data folder"):
        site_data(site_cfg(), "imagefolder", "", 0)


def test_numeric_labels_keep_their_index(tmp_path):
    rng = np.random.default_rng(0)
    npz = tmp_path / "m.npz"
    np.savez(npz, train_images=rng.integers(0, 255, (20, 8, 8), dtype=np.uint8),
             train_labels=np.array([0, 2] * 10)[:, None],
             test_images=rng.integers(0, 255, (4, 8, 8), dtype=np.uint8),
             test_labels=np.array([[0], [2], [2], [0]]))
    fed = site_data(site_cfg(), "medmnist", str(npz), 2)
    assert fed.train_sizes.tolist() == [0, 0, 20]  # the .npz's test arrays are held out
    assert fed.client_test(2)[1].tolist() == [0, 2, 2, 0]
    with pytest.raises(ProtoflError, match="label 2, but the federation has 2 classes"):
        site_data(site_cfg(classes=[], num_classes=2), "medmnist", str(npz), 0)


def test_label_map_hand_cases():
    ag = agreement(site_cfg())
    assert label_map(["c", "a"], np.array([1, 1]), ag, "s").tolist() == [2, 0]
    assert label_map(["c", "x"], np.array([1, 0]), ag, "s").tolist() == [2, -1]  # x unused
    assert label_map(["0", "1"], np.array([3, 1]), ag, "s").tolist() == [0, 1]


# ---- the server's view ----

def test_server_federation_without_and_with_a_test_set(tmp_path):
    fed = server_federation(site_cfg())
    assert isinstance(fed, SiteFederation) and fed.num_clients == 3
    assert len(fed.y_train) == 0 and len(fed.y_test) == 0 and fed.input_shape == (1, 8, 8)
    with pytest.raises(ProtoflError, match="run it on Flower"):
        _ = fed.train_sizes
    fed.set_sizes(np.array([4, 0, 9]))
    assert fed.train_sizes.tolist() == [4, 0, 9]
    with pytest.raises(ProtoflError, match="do not fit 3 sites"):
        fed.set_sizes(np.array([1, 2]))
    write_site(tmp_path, {"b": 5, "c": 5}, ABC)
    fed = server_federation(site_cfg(root=str(tmp_path)))
    assert sorted(fed.y_test.tolist()) == [1] * 5 + [2] * 5  # every sample at data.root


def test_site_runs_only_on_flower(tmp_path):
    cfg = config_from_dict({"data": {"name": "site", "num_clients": 2, "classes": ["a", "b"],
                                     "input_shape": [1, 8, 8]}, "model": {"name": "mlp"},
                            "clients": {"per_round": 2}})
    with pytest.raises(ProtoflError, match="run it with `flwr run`"):
        run_experiment(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


class SitesInProcess:
    """A trainer that trains each client on its own site's Experiment, as SuperNodes do."""

    name = "sites"

    def __init__(self, nodes: dict[int, Experiment]):
        self.nodes = nodes

    def train(self, rc):
        out = []
        for job in rc.jobs:
            node = self.nodes[job.client]
            sub = dataclasses.replace(rc, alg=node.alg, data=node.data)
            out += SequentialTrainer().train(dataclasses.replace(sub, jobs=[job]))
        return out


@pytest.mark.parametrize("algorithm, amm", [("fedavg", False), ("fedmargin", True)])
def test_server_skips_metrics_that_need_training_data(tmp_path, algorithm, amm):
    cfg = config_from_dict({
        "algorithm": algorithm, "rounds": 1, "trainer": "sequential",
        "data": {"name": "site", "num_clients": 2, "classes": ABC, "input_shape": [1, 8, 8]},
        "model": {"name": "mlp"}, "clients": {"per_round": 2, "batch_size": 4}})
    for k in range(2):
        write_site(tmp_path / f"s{k}", {"a": 6, "b": 6, "c": 6}, ABC, seed=k)
    exp = Experiment(cfg, trainer=SitesInProcess({}))
    nodes = {k: Experiment(exp.cfg, data=site_data(exp.cfg.data, "imagefolder",
                                                   str(tmp_path / f"s{k}"), k))
             for k in range(2)}
    exp.trainer = SitesInProcess(nodes)
    exp.data.set_sizes(np.array([15, 15]))
    record = exp.step()
    assert record["clients"] == [0, 1]
    assert "train_loss" not in record and "dissimilarity" not in record
    assert ("amm" in record) == amm
    assert "accuracy" not in record  # the server has no test set and no client rows


# ---- federated evaluation figures ----

def test_pooled_figures_weigh_sites_by_size():
    # site 0: 4 samples, 3 right; site 1: 1 sample, wrong; site 2: nothing held out
    y0, p0 = np.array([0, 0, 1, 1]), np.array([0, 0, 1, 0])
    y1, p1 = np.array([1]), np.array([0])
    sites = {0: SiteScore(confusion(y0, p0, 2), 2.0), 1: SiteScore(confusion(y1, p1, 2), 3.0),
             2: SiteScore(np.zeros((2, 2), dtype=np.int64), 0.0)}
    got = pooled_figures(sites)
    assert got["accuracy"] == pytest.approx(3 / 5)  # not the mean of 3/4 and 0
    assert got["loss"] == pytest.approx((2.0 + 3.0) / 5)
    assert got["local_accuracy"] == pytest.approx((3 / 4 + 0) / 2)
    assert got["client_accuracy"] == {"0": 0.75, "1": 0.0}
    assert got["clients_evaluated"] == 2
    ref = report(np.concatenate([y0, y1]), np.concatenate([p0, p1]), 2)
    for k in ("balanced_accuracy", "f1_macro", "precision_weighted", "confusion"):
        assert got[k] == ref[k]
    assert pooled_figures({2: sites[2]}) == {}


def test_score_split_matches_a_direct_computation():
    exp = Experiment(config_from_dict({"algorithm": "fedavg", "data": {"name": "digits"}}))
    x, y = exp.data.inputs(exp.data.x_test[:50]), exp.data.y_test[:50]
    w = exp.alg.global_weights(exp.state)
    s = score_split(exp.alg, exp.alg.model, w, exp.state, x, y, 10)
    with torch.no_grad():
        logits = exp.alg.model(x)[1]
    assert s.n == 50
    assert np.trace(s.confusion) == int((logits.argmax(1) == y).sum())
    assert s.loss_sum == pytest.approx(float(torch.nn.functional.cross_entropy(
        logits, y, reduction="sum")), rel=1e-5)
    assert score_split(exp.alg, exp.alg.model, None, exp.state, x, y, 10).n == 0
