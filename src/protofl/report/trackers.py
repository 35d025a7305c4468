"""Experiment tracking, optional: TensorBoard event files and MLflow runs.

A tracker is three calls made by the round loop: ``start(config, folder)`` once, with the
resolved config and the run folder; ``log_round(record)`` with each round's metrics record
(the line written to ``metrics.jsonl``; ``round`` is the step); ``finish(folder)`` at the
end. Numbers are logged as scalars; lists and per-client dicts are not, except the
aggregation ``weights`` (a histogram in TensorBoard).

- ``TensorBoardTracker``: event files (``torch.utils.tensorboard``; needs the
  ``tensorboard`` package: ``pip install 'protofl[tensorboard]'``) in ``logdir`` or
  ``<run folder>/tensorboard``; view with ``tensorboard --logdir DIR``.
- ``MLflowTracker``: params (the flattened config), per-round metrics and, at the end, the
  run folder's files as artefacts (``pip install 'protofl[mlflow]'``). ``target`` is a
  directory (a local store: ``DIR/mlflow.db``, SQLite, and ``DIR/artifacts``; no server;
  view with ``mlflow ui --backend-store-uri sqlite:///DIR/mlflow.db``) or any MLflow
  tracking URI.

:class:`Tracking` is the round callback that drives them for a run (``tracking: [tensorboard,
mlflow]`` in the config, or ``protofl run --log NAME``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Protocol

from protofl.engine import runfolder
from protofl.engine.callbacks import Callback
from protofl.errors import ProtoflError

TRACKERS = ("tensorboard", "mlflow")
STATE = "tracking.json"  # in the run folder: the MLflow run, the last round logged


class Tracker(Protocol):
    def start(self, config: dict, folder: Path) -> None: ...

    def log_round(self, record: dict) -> None: ...

    def finish(self, folder: Path) -> None: ...


def scalars(record: dict) -> dict[str, float]:
    """The record's finite numbers (not ``round``, not booleans)."""
    return {k: float(v) for k, v in record.items() if k != "round" and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flat_params(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if not isinstance(v, str) else v
    return out


def _missing(package: str, extra: str) -> ProtoflError:
    return ProtoflError(f"--log {extra} needs the {package} package: "
                        f"pip install 'protofl[{extra}]'")


class TensorBoardTracker:
    """Scalars per round (step = round) and the config as text, in TensorBoard event files."""

    def __init__(self, logdir: str | Path | None = None):
        self.logdir = Path(logdir) if logdir is not None else None
        self.writer = None

    def start(self, config: dict, folder: Path) -> None:
        """Start writing into ``folder/tensorboard`` (the place a run folder's store lends it:
        ``RunStore.place``) unless the tracker was given its own ``logdir``."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise _missing("tensorboard", "tensorboard") from None
        logdir = self.logdir or Path(folder) / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(logdir))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)

    def log_round(self, record: dict) -> None:
        step = int(record["round"])
        for k, v in scalars(record).items():
            self.writer.add_scalar(k, v, step)
        for key in ("weights", "fedavg_weights"):
            if record.get(key):
                import numpy as np

                self.writer.add_histogram(key, np.asarray(record[key], dtype=float), step)

    def finish(self, folder: Path) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class MLflowTracker:
    """An MLflow run: params, metrics per round (step = round) and the run folder's files."""

    # checkpoints are large and resumable only by protofl; the lock and half-written files
    SKIP = (runfolder.CHECKPOINT, runfolder.LEGACY_CHECKPOINT, runfolder.LOCK, ".tmp")

    def __init__(self, target: str | Path, experiment: str = "protofl",
                 run_name: str | None = None, run_id: str | None = None):
        self.target, self.experiment, self.run_name = str(target), experiment, run_name
        self.run_id = run_id  # continue this run (a resumed protofl run) instead of a new one
        self.client = None
        self.uri: str | None = None  # the tracking URI in use, once started

    def _uri(self) -> tuple[str, str | None]:
        if "://" in self.target or self.target.startswith(("file:", "sqlite:")):
            return self.target, None
        root = Path(self.target).resolve()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ProtoflError(f"mlflow: cannot create {root}: {e.strerror or e}") from None
        return f"sqlite:///{root / 'mlflow.db'}", (root / "artifacts").as_uri()

    def start(self, config: dict, folder: Path) -> None:
        try:
            from mlflow.entities import Param
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise _missing("mlflow", "mlflow") from None
        for name in ("mlflow.store.db.utils", "alembic"):  # table creation chatter
            logging.getLogger(name).setLevel(logging.WARNING)
        uri, artifacts = self._uri()
        self.uri = uri
        try:
            self.client = MlflowClient(tracking_uri=uri)
            exp = self.client.get_experiment_by_name(self.experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(
                self.experiment, artifact_location=artifacts)
            if self.run_id is None:
                name = self.run_name or Path(folder).name
                run = self.client.create_run(exp_id, run_name=name,
                                             tags={"protofl.folder": str(Path(folder))})
                self.run_id = run.info.run_id
                params = [Param(k, v[:6000]) for k, v in flat_params(config).items()]
                for i in range(0, len(params), 100):  # MLflow takes 100 params per batch
                    self.client.log_batch(self.run_id, params=params[i:i + 100])
        except MlflowException as e:
            first = str(e.message if hasattr(e, "message") else e).splitlines()[0]
            raise ProtoflError(f"mlflow ({uri}): {first}") from None

    def log_round(self, record: dict) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(record["round"])
        metrics = [Metric(k, v, now, step) for k, v in scalars(record).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, folder: Path, status: str = "FINISHED") -> None:
        for path in sorted(Path(folder).iterdir()):
            if path.is_file() and not path.name.endswith(self.SKIP):
                self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id, status)


def make_tracker(name: str, target: Any = None, run_name: str | None = None,
                 run_id: str | None = None) -> Tracker:
    """``tensorboard`` (target: log dir, default in the run folder) or ``mlflow`` (target:
    a directory or tracking URI, default ``mlruns``; ``run_id`` continues that run)."""
    if name == "tensorboard":
        return TensorBoardTracker(target)
    if name == "mlflow":
        return MLflowTracker(target or "mlruns", run_name=run_name, run_id=run_id)
    raise ProtoflError(f"--log {name!r} unknown; allowed: {', '.join(TRACKERS)}")


def require(names: list[str]) -> None:
    """Refuse, before anything is written, trackers whose package is not installed (each
    tracker's package has its name)."""
    for name in names:
        if name not in TRACKERS:
            raise ProtoflError(f"tracking: {name!r} unknown; allowed: {', '.join(TRACKERS)}")
        if importlib.util.find_spec(name) is None:
            raise _missing(name, name)


class Tracking(Callback):
    """The trackers named by ``cfg.tracking``, fed by the round loop: started once the run
    folder is prepared, given each evaluated round after its line is written, finished after
    the summary and plots (so MLflow gets them as artefacts). ``tracking.json`` in the run
    folder keeps the MLflow run (store and id) and the last round logged: a resumed run
    continues the same MLflow run and logs no round twice. A fresh run clears the TensorBoard
    event files a replaced run left. Reads and writes the folder through the run's store;
    finishes after the store's summary and ``PlotRun``'s figures."""

    def __init__(self) -> None:
        self.store: Any = None
        self.trackers: dict[str, Any] = {}
        self.state: dict[str, Any] = {}

    def on_run_start(self, view) -> None:
        names = list(dict.fromkeys(view.cfg.tracking))
        if not names or view.store is None:
            return
        require(names)
        self.store = store = view.store
        prev = (store.read_json(STATE) or {}) if view.round else {}
        self.state = {"logged_round": prev.get("logged_round", 0)}
        for name in names:
            if name == "mlflow":
                old = prev.get("mlflow", {})
                tracker: Any = make_tracker(name, old.get("uri") or view.cfg.tracking_dir,
                                            "/".join(store.out.parts[-3:]), old.get("run_id"))
            else:
                tracker = make_tracker(name)
                store.place("tensorboard", None if view.round else "events.out.tfevents.*")
            tracker.start(view.cfg.to_dict(), store.out)
            if name == "mlflow":
                self.state["mlflow"] = {"uri": tracker.uri, "run_id": tracker.run_id}
            self.trackers[name] = tracker
        store.write_json(STATE, self.state)

    def on_round_end(self, view, record) -> None:
        t = record["round"]
        if not self.trackers or not view.evaluating(t) or t <= self.state["logged_round"]:
            return  # a resumed run recomputes rounds it had already logged
        for tracker in self.trackers.values():
            tracker.log_round(record)
        self.state["logged_round"] = t
        self.store.write_json(STATE, self.state)

    def on_run_end(self, view, summary) -> None:
        for tracker in self.trackers.values():
            tracker.finish(self.store.out)
