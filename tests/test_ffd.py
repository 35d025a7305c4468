"""Per-round reference weights and the FFD callback, end to end on tiny runs."""

import json
import shutil

import numpy as np
import pytest
import torch

from protofl.api import run_experiment
from protofl.config import config_from_dict, merge
from protofl.engine import reference, tensorfile
from protofl.engine.callbacks import Callback
from protofl.engine.runfolder import LOCK, RunStore, load_checkpoint, read_metrics
from protofl.errors import ProtoflError
from protofl.models.registry import build_model
from protofl.report.compare import load_runs, make_tables, table4

TINY = {"rounds": 2, "data": {"num_clients": 6},
        "clients": {"per_round": 3, "local_steps": 2},
        "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 0, "ffd_probe": 16}}


def tiny(**over) -> dict:
    return merge(TINY, over)


class Capture(Callback):
    """Keeps each round's client models (as their uploads hold them)."""

    def __init__(self):
        self.models = {}

    def after_aggregate(self, exp, record, results):
        self.models[record["round"]] = [exp.alg.client_weights(r.upload) for r in results]


def numpy_mmd2_biased(x: np.ndarray, y: np.ndarray) -> float:
    """Biased MMD², Gaussian kernel, σ = median pairwise distance of the pooled rows: numpy."""
    z = np.concatenate([x, y]).astype(np.float64)
    d = np.sqrt(((z[:, None, :] - z[None, :, :]) ** 2).sum(-1))
    sigma = np.median(d[np.triu_indices(len(z), 1)])
    k = np.exp(-d ** 2 / (2 * sigma ** 2))
    m = len(x)
    return float(k[:m, :m].mean() + k[m:, m:].mean() - 2 * k[:m, m:].mean())


def plain_features(weights: dict, x: torch.Tensor) -> np.ndarray:
    """The MLP's features with an ordinary module and ``load_state_dict``."""
    model = build_model("mlp", tuple(x.shape[1:]), 10)
    model.load_state_dict({**weights["params"], **weights["buffers"]}, strict=True)
    model.eval()
    with torch.no_grad():
        return model(x)[0].numpy()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ffd")
    captured = {}
    with pytest.MonkeyPatch.context() as mp:  # no figures: not what is tested here
        mp.setattr("protofl.report.plots.plot_run", lambda folder: None)
        mp.setattr("protofl.report.stats.write_stats", lambda data, out: None)
        run_experiment(config_from_dict(tiny(algorithm="central")), root / "central")
        for alg in ("fedavg", "fedmargin"):
            cap = Capture()
            raw = tiny(algorithm=alg, metrics={"ffd_reference": str(root / "central")})
            run_experiment(config_from_dict(raw), root / alg, callbacks=[cap])
            captured[alg] = cap.models
    return root, captured


def test_central_keeps_every_round_as_plain_tensors(runs):
    root, _ = runs
    cfg = json.loads((root / "central" / "config.json").read_text())
    assert cfg["metrics"]["save_weights"] is True  # central's default, resolved
    assert json.loads((root / "fedavg" / "config.json").read_text())["metrics"][
        "save_weights"] is False
    files = sorted(p.name for p in (root / "central" / "weights").iterdir())
    assert files == ["round_0001.safetensors", "round_0002.safetensors"]
    saved = reference.load_weights(root / "central" / "weights" / "round_0002.safetensors")
    final = load_checkpoint(root / "central")["state"]
    assert saved["params"].keys() == final["params"].keys()
    for k, v in final["params"].items():
        assert torch.equal(saved["params"][k], v)


def test_mmd_matches_an_independent_computation(runs):
    root, captured = runs
    from protofl.data.registry import load_dataset

    data = load_dataset(config_from_dict(tiny()).data)
    n = len(data.y_test)
    assert n > 16  # so the probe is a real subset
    # the documented probe: 16 global-test rows drawn with (data.seed, PROBE = 4, 1)
    idx = np.sort(np.random.default_rng([0, 4, 1]).choice(n, 16, replace=False))
    x = data.x_test[torch.from_numpy(idx)]
    ref_state = reference.load_weights(root / "central" / "weights" / "round_0002.safetensors")
    ref = plain_features(ref_state, x)
    for alg in ("fedavg", "fedmargin"):
        rows = read_metrics(root / alg)
        assert all("mmd" in r for r in rows)
        clients = captured[alg][2]
        assert len(clients) == 3
        expect = np.mean([numpy_mmd2_biased(plain_features(w, x), ref) for w in clients])
        assert rows[-1]["mmd"] == pytest.approx(expect, rel=1e-6, abs=1e-9)
    # compare turns the final mmd into FFD against fedavg
    t = make_tables(load_runs([root / "central", root / "fedavg", root / "fedmargin"]))[0]
    t4 = table4(t)
    a, m = (read_metrics(root / alg)[-1]["mmd"] for alg in ("fedavg", "fedmargin"))
    assert t4["ffd"]["fedmargin"] == pytest.approx(100 * (a - m) / a)
    assert [row.label for row in t.rows] == ["fedavg", "fedmargin", "central"]
    assert t4["pairs"] == 2  # Pearson over the federated runs only
    assert "central: one client" in t.caption


def test_the_probe_does_not_depend_on_the_run_seed():
    data = pytest.importorskip("protofl.data.registry").load_dataset(
        config_from_dict(tiny()).data)
    a = reference.probe(data, 16, data_seed=0)
    assert torch.equal(a, reference.probe(data, 16, data_seed=0))
    assert not torch.equal(a, reference.probe(data, 16, data_seed=1))
    assert len(reference.probe(data, 10**6, 0)) == len(data.y_test)  # all of a small set


def _refused(raw: dict, out, needle: str):
    with pytest.raises(ProtoflError, match=needle):
        run_experiment(config_from_dict(raw), out)
    left = [p.name for p in out.iterdir() if p.name != LOCK] if out.exists() else []
    assert left == []  # refused before the run wrote a file (a new folder holds its lock)


@pytest.mark.parametrize("over, needle", [
    ({"rounds": 3}, "has 2 rounds, this run needs the reference at round 3"),
    ({"data": {"name": "digits"}}, "ran on 'synthetic', this run on 'digits'"),
])
def test_a_reference_that_does_not_fit_is_refused(runs, tmp_path, over, needle):
    root, _ = runs
    raw = merge(tiny(algorithm="fedavg", metrics={"ffd_reference": str(root / "central")}),
                over)
    _refused(raw, tmp_path / "run", needle)


def test_another_model_or_unfitting_weights_are_refused(runs, tmp_path):
    root, _ = runs
    ref = tmp_path / "ref"
    shutil.copytree(root / "central", ref)
    raw = tiny(algorithm="fedavg", metrics={"ffd_reference": str(ref)})
    cfg = json.loads((ref / "config.json").read_text())
    (ref / "config.json").write_text(json.dumps(merge(cfg, {"model": {"name": "digits_cnn"}})))
    _refused(raw, tmp_path / "a", "trained model 'digits_cnn'.*same architecture")
    (ref / "config.json").write_text(json.dumps(cfg))
    RunStore(ref).round_end({"round": 1}, False,
                            weights={"params": {"w": torch.zeros(3)}, "buffers": {}})
    _refused(raw, tmp_path / "b", "does not fit the reference's model")
    (ref / "weights" / "round_0002.safetensors").unlink()
    _refused(raw, tmp_path / "c", "lacks .*round_0002.safetensors")


def test_a_reference_without_weights_is_refused(runs, tmp_path):
    root, _ = runs
    raw = tiny(algorithm="fedavg", metrics={"ffd_reference": str(root / "fedavg")})
    _refused(raw, tmp_path / "a", "did not save its weights")
    raw["metrics"]["ffd_reference"] = str(tmp_path)
    _refused(raw, tmp_path / "b", "not a run folder")


def test_a_torn_or_foreign_weights_file_is_one_clear_line(runs, tmp_path):
    path = tmp_path / "round_0001.safetensors"
    torch.save({"params.w": torch.zeros(2), "code": Capture()}, path)  # pickled object
    with pytest.raises(ProtoflError, match="cannot be read as saved weights"):
        reference.load_weights(path)
    path.write_bytes(b"torn")
    with pytest.raises(ProtoflError, match="cannot be read"):
        reference.load_weights(path)
    path.write_bytes(tensorfile.encode({"weird": {"w": torch.zeros(2)}}))
    with pytest.raises(ProtoflError, match="does not hold a model's weights"):
        reference.load_weights(path)


def test_personalised_methods_compare_the_model_each_client_keeps(runs, tmp_path):
    root, _ = runs
    raw = tiny(algorithm="fedproto", rounds=1,
               metrics={"ffd_reference": str(root / "central")})
    run_experiment(config_from_dict(raw), tmp_path / "proto")
    assert read_metrics(tmp_path / "proto")[-1]["mmd"] > 0
    _refused(tiny(algorithm="fedproto", rounds=1, metrics={"save_weights": True}),
             tmp_path / "saving", "no aggregate model")


def test_overwriting_a_run_removes_its_old_round_files(tmp_path):
    out = tmp_path / "central"
    run_experiment(config_from_dict(tiny(algorithm="central", rounds=2)), out)
    run_experiment(config_from_dict(tiny(algorithm="central", rounds=1)), out, overwrite=True)
    assert sorted(p.name for p in (out / "weights").iterdir()) == ["round_0001.safetensors"]
