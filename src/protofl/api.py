"""The Python API for notebooks and scripts: run, resume and compare experiments.

    import protofl
    run = protofl.run({"algorithm": "fedmargin", "rounds": 20})   # or a YAML path, a Config
    run.records[-1]["accuracy"], run.frame()                      # metrics (a DataFrame)
    model = run.model()                                           # the final model

Running changes no global state of the caller: torch's generator and thread count are as
they were, and figures are drawn without pyplot (no matplotlib backend is set).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from protofl import device as devices
from protofl import plugins
from protofl.config import Config, config_from_dict, load_raw
from protofl.data.federated import FederatedData
from protofl.data.registry import with_task_dataset
from protofl.data.site import SiteFederation
from protofl.engine import federation, runfolder
from protofl.engine.callbacks import Callback, Progress
from protofl.engine.experiment import Experiment
from protofl.engine.federation import Federation
from protofl.engine.runfolder import RunStore
from protofl.engine.spec import RunSpec
from protofl.errors import Diverged, ProtoflError
from protofl.report.plots import PlotRun
from protofl.report.stats import PartitionStats
from protofl.report.trackers import Tracking, require

log = logging.getLogger("protofl")


def folder_callbacks(out: Path | None, progress: bool) -> list[Callback]:
    """The callbacks of a run written to ``out`` (none without it), in the order they must
    run: partition statistics, plots, trackers (each writing through the run's store); and a
    progress bar."""
    cbs: list[Callback] = [PartitionStats(), PlotRun(), Tracking()] if out is not None else []
    return cbs + ([Progress()] if progress else [])


def runnable(exp: Experiment, out: Path | None) -> Experiment:
    """``exp``, after refusing what can be refused before a run folder is touched: a site
    federation (its data are on the sites) and tracking without a run folder or its package."""
    if isinstance(exp.data, SiteFederation):
        raise ProtoflError("data.name site: the training data are on the sites, each trained "
                           "by its own Flower SuperNode; run it with `flwr run` "
                           "(docs/flower.md, site mode)")
    if exp.cfg.tracking and out is None:
        raise ProtoflError("tracking needs a run folder (out)")
    require(exp.cfg.tracking)
    return exp


def run_in_folder(exp: Experiment) -> dict:
    """``exp.run()``, holding its store's lock when it has one; a diverged run's message
    says what the folder keeps."""
    if exp.store is None:
        return exp.run()
    with exp.store.lock():
        try:
            return exp.run()
        except Diverged as e:
            saved, out = exp.store.saved, exp.store.out
            kept = (f"{out} keeps its checkpoint of round {saved}" if saved else
                    f"{out} has no checkpoint yet (start again with --overwrite)")
            raise Diverged(f"{e}; {kept}") from None


def experiment(cfg: Config, out: str | Path | None, overwrite: bool, progress: bool,
               callbacks: Sequence[Callback]) -> Experiment:
    """The Experiment of ``cfg``, written to ``out`` (None: nowhere) by its RunStore, with the
    default callbacks, those of a run folder and ``callbacks``."""
    out = Path(out) if out is not None else None
    store = None if out is None else RunStore(out, overwrite)
    if store is not None:
        store.check_fresh()  # before the data are built and the folder is locked
    exp = runnable(Experiment(cfg, store=store), out)
    exp.callbacks += [*folder_callbacks(out, progress), *callbacks]
    return exp


def run_experiment(cfg: Config, out: str | Path | None = None, *, overwrite: bool = False,
                   progress: bool = False, callbacks: Sequence[Callback] = ()) -> dict:
    """Run ``cfg`` to the end, writing a run folder at ``out`` if given (held locked against
    a second writer); ``callbacks`` are added to the default ones. Returns the summary."""
    return run_in_folder(experiment(cfg, out, overwrite, progress, callbacks))


def resume_experiment(out: str | Path, rounds: int | None = None, progress: bool = False,
                      callbacks: Sequence[Callback] = (), device: str | None = None,
                      settings: Sequence[str] = ()) -> dict:
    """Continue a killed run from its last checkpoint; it ends as an uninterrupted run would.
    The folder is verified first (``RunStore.verify``: a changed or corrupted file is refused).
    ``rounds`` is the run's new total: more than configured extends it, fewer (never below the
    checkpoint's round) ends it sooner, with a warning; ``device`` trains the rest elsewhere
    (checkpoints are device-independent); ``settings`` (``KEY=VALUE``, as ``--set``) change
    settings from here on. Every change is recorded in the run's history (``manifest.json``)."""
    from protofl.config import apply_set

    store = RunStore(out)
    if not store.is_run():  # before the lock, which would create the folder
        raise ProtoflError(f"{store.out} is not a run folder (no {runfolder.CONFIG}): nothing "
                           "to resume")
    with store.lock():
        if store.verify() is None:
            log.warning("%s has no %s (written by protofl 0.1): its files cannot be checked; "
                        "it gets one now", store.out, runfolder.mf.MANIFEST)
        raw = store.config()
        for s in settings:
            apply_set(raw, s)
        cfg = config_from_dict(raw)
        plugins.check(cfg.plugins)
        snapshot = store.checkpoint()
        if rounds is not None:
            done = snapshot.get("round")
            if isinstance(done, int) and rounds < done:
                raise ProtoflError(f"--rounds {rounds}: {store.out} has already run {done} "
                                   f"round{'s' * (done != 1)}; give at least {done}")
            if rounds < cfg.rounds:
                log.warning("--rounds %d is fewer than the %d configured: the run ends sooner, "
                            "at round %d", rounds, cfg.rounds, rounds)
            cfg = dataclasses.replace(cfg, rounds=rounds)
        if device is not None:
            cfg = config_from_dict({**cfg.to_dict(), "device": device})
        exp = runnable(Experiment(cfg, store=store), store.out)
        runfolder.check_resumable(store.out, snapshot, exp.alg.name, exp.state)
        exp.callbacks += [*folder_callbacks(store.out, progress), *callbacks]
        exp.resume(snapshot)
        return run_in_folder(exp)


class Records(Callback):
    """Keeps the record of every evaluated round (the lines of ``metrics.jsonl``)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def on_run_start(self, exp):
        self.rows = [r for r in self.rows if r["round"] <= exp.round]

    def on_round_end(self, exp, record):
        if exp.evaluating(record["round"]):
            self.rows.append(dict(record))


@dataclass
class Run:
    """A finished run: its resolved spec, metrics, summary, final state and folder."""

    spec: RunSpec
    records: list[dict]  # one per evaluated round, as in metrics.jsonl
    summary: dict
    folder: Path | None
    experiment: Experiment

    def frame(self) -> Any:
        """The records as a pandas DataFrame (needs pandas)."""
        try:
            import pandas as pd
        except ImportError:
            raise ProtoflError("Run.frame needs pandas (pip install pandas); Run.records "
                               "holds the same rows") from None
        return pd.DataFrame(self.records)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The final aggregate model's weights as a plain state_dict (on the CPU), for
        ``run.model()`` or any copy of ``experiment.alg.model``."""
        exp = self.experiment
        weights = exp.alg.global_weights(exp.state)
        if weights is None:
            raise ProtoflError(f"{exp.alg.name} has no aggregate model: each client keeps its "
                               "own (Run.experiment.client_states)")
        return devices.to_host({**weights["params"], **weights["buffers"]})

    def model(self) -> torch.nn.Module:
        """A CPU copy of the model trained, holding the final aggregate weights."""
        model = copy.deepcopy(self.experiment.alg.model).to("cpu")
        model.load_state_dict(self.state_dict())
        return model


def as_config(config: Config | dict | str | Path | None) -> Config:
    """A Config from a Config, a mapping with the YAML's keys (where a plugin may be the class
    or factory itself: ``{"algorithm": MyAlgorithm}``), or a YAML/JSON file's path."""
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    raw = plugins.name_objects(config) if isinstance(config, dict) else load_raw(config)
    return config_from_dict(with_task_dataset(raw))  # "task" alone: its default dataset


def build(config: Config | dict | str | Path | None = None,
          data: FederatedData | None = None) -> Federation:
    """The :class:`~protofl.engine.federation.Federation` ``config`` names (a Config, a dict
    with the YAML's keys or a config file's path), built but not run; ``data`` replaces the
    federation its data section names."""
    return federation.build(as_config(config), data)


def run(config: Config | dict | str | Path | None = None, out: str | Path | None = None, *,
        overwrite: bool = False, progress: bool = False,
        callbacks: Sequence[Callback] = ()) -> Run:
    """Run ``config`` (a Config, a dict with the YAML's keys or a config file's path) to the
    end, writing a run folder at ``out`` if given; returns the :class:`Run`."""
    records = Records()
    exp = experiment(as_config(config), out, overwrite, progress, [records, *callbacks])
    summary = run_in_folder(exp)
    return Run(exp.cfg, records.rows, summary, None if out is None else Path(out), exp)
