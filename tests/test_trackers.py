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
    assert "checkpoint.pt" not in names
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
