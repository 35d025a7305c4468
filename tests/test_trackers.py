import importlib.util
import json
import sys

import pytest
from fakeruns import make_run

from protofl.errors import ProtoflError
from protofl.report.trackers import MLflowTracker, TensorBoardTracker, make_tracker


def _records(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = make_run(tmp_path / "run", "fedmargin", rounds=3, weights=True)
    tracker = make_tracker("tensorboard")
    tracker.start(json.loads((run / "config.json").read_text()), run)
    for r in _records(run):
        tracker.log_round(r)
    tracker.finish(run)
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    assert {"accuracy", "amm", "loss", "seconds"} <= set(tags["scalars"])
    assert "client_accuracy" not in tags["scalars"] and "round" not in tags["scalars"]
    events = acc.Scalars("accuracy")
    assert [e.step for e in events] == [1, 2, 3]
    assert [e.value for e in events] == pytest.approx([r["accuracy"] for r in _records(run)])
    assert "weights" in tags["histograms"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # SQLAlchemy 2.1 inside MLflow
def test_mlflow_local_store(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    run = make_run(tmp_path / "run", "fedmargin", rounds=3)
    (run / "checkpoint.pt").write_bytes(b"not logged")
    (run / "checkpoint.safetensors").write_bytes(b"not logged either")
    store = tmp_path / "mlruns"
    tracker = MLflowTracker(store, run_name="fedmargin-seed0")
    tracker.start(json.loads((run / "config.json").read_text()), run)
    for r in _records(run):
        tracker.log_round(r)
    tracker.finish(run)
    client = MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}")
    got = client.get_run(tracker.run_id)
    assert got.info.status == "FINISHED" and got.info.run_name == "fedmargin-seed0"
    assert got.data.params["algorithm"] == "fedmargin"
    assert got.data.params["clients.per_round"] == "3"
    history = client.get_metric_history(tracker.run_id, "accuracy")
    assert sorted(m.step for m in history) == [1, 2, 3]
    assert sorted(m.value for m in history) == pytest.approx(
        sorted(r["accuracy"] for r in _records(run)))
    names = {a.path for a in client.list_artifacts(tracker.run_id)}
    assert {"config.json", "metrics.jsonl", "summary.json"} <= names
    assert "checkpoint.pt" not in names and "checkpoint.safetensors" not in names
    assert (store / "artifacts").is_dir()  # everything stays in the local folder


def test_unknown_or_missing_tracker_is_one_clear_line(monkeypatch, tmp_path):
    with pytest.raises(ProtoflError, match="allowed: tensorboard, mlflow"):
        make_tracker("wandb")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ProtoflError, match=r"pip install 'protofl\[tensorboard\]'"):
        TensorBoardTracker().start({}, tmp_path)
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    with pytest.raises(ProtoflError, match=r"pip install 'protofl\[mlflow\]'"):
        MLflowTracker(tmp_path).start({}, tmp_path)


TINY_RUN = {"rounds": 4, "checkpoint_every": 2, "data": {"num_clients": 6},
            "clients": {"per_round": 3, "local_steps": 2},
            "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 0}}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # SQLAlchemy 2.1 inside MLflow
def test_run_logs_to_both_trackers_and_resume_continues_the_mlflow_run(tmp_path, kill_after):
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from protofl.api import resume_experiment
    from protofl.cli import main

    store, out = tmp_path / "store", tmp_path / "run"
    args = ["run", "-q", "--out", str(out), "--log", "tensorboard", "--log", "mlflow",
            "--log-dir", str(store), "--rounds", "4", "--set", "checkpoint_every=2",
            "--set", "data.num_clients=6", "--set", "clients.per_round=3",
            "--set", "clients.local_steps=2", "--set", "metrics.dissimilarity_clients=0",
            "--set", "metrics.train_loss_samples=0"]
    with kill_after(3):  # killed in round 4, after the round-2 checkpoint
        assert main(args) == 130  # interrupted
    state = json.loads((out / "tracking.json").read_text())
    assert state["logged_round"] == 3
    resume_experiment(out)
    assert json.loads((out / "tracking.json").read_text()) == {**state, "logged_round": 4}

    client = MlflowClient(tracking_uri=state["mlflow"]["uri"])
    assert state["mlflow"]["uri"] == f"sqlite:///{(store / 'mlflow.db').resolve()}"
    runs = client.search_runs([client.get_experiment_by_name("protofl").experiment_id])
    assert [r.info.run_id for r in runs] == [state["mlflow"]["run_id"]]  # one run, continued
    got = runs[0]
    assert got.info.status == "FINISHED" and got.data.params["tracking"] == '["tensorboard", ' \
        '"mlflow"]'
    history = client.get_metric_history(got.info.run_id, "accuracy")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]  # round 3 logged once
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(
        [r["accuracy"] for r in _records(out)])
    names = {a.path for a in client.list_artifacts(got.info.run_id)}
    assert {"config.json", "metrics.jsonl", "summary.json", "curves.png", "stats.json"} <= names
    assert "checkpoint.safetensors" not in names and ".protofl.lock" not in names

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert sorted(e.step for e in acc.Scalars("accuracy")) == [1, 2, 3, 4]


def test_tracking_needs_its_package_and_a_run_folder(tmp_path, monkeypatch):
    from protofl.api import run_experiment
    from protofl.config import config_from_dict

    cfg = config_from_dict({**TINY_RUN, "tracking": ["tensorboard"]})
    with pytest.raises(ProtoflError, match="tracking needs a run folder"):
        run_experiment(cfg)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ProtoflError, match=r"pip install 'protofl\[tensorboard\]'"):
        run_experiment(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before the folder is made
