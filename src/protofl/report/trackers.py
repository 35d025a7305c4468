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
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Protocol

from protofl.errors import ProtoflError

TRACKERS = ("tensorboard", "mlflow")


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

    SKIP = (".pt", ".tmp")  # checkpoints are large and resumable only by protofl

    def __init__(self, target: str | Path, experiment: str = "protofl",
                 run_name: str | None = None, run_id: str | None = None):
        self.target, self.experiment, self.run_name = str(target), experiment, run_name
        self.run_id = run_id  # continue this run (a resumed protofl run) instead of a new one
        self.client = None

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


def make_tracker(name: str, target: Any = None) -> Tracker:
    """``tensorboard`` (target: log dir, default in the run folder) or ``mlflow`` (target:
    a directory or tracking URI, default ``mlruns``)."""
    if name == "tensorboard":
        return TensorBoardTracker(target)
    if name == "mlflow":
        return MLflowTracker(target if target is not None else "mlruns")
    raise ProtoflError(f"--log {name!r} unknown; allowed: {', '.join(TRACKERS)}")
