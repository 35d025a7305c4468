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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from protofl import device as devices
from protofl.config import Config, config_from_dict, load_raw
from protofl.data.site import SiteFederation
from protofl.engine import runfolder
from protofl.engine.callbacks import Callback, Progress, RunFolder, SaveWeights
from protofl.engine.experiment import Experiment
from protofl.engine.spec import RunSpec
from protofl.errors import Diverged, ProtoflError
from protofl.report.plots import PlotRun
from protofl.report.stats import PartitionStats
from protofl.report.trackers import Tracking, require


def folder_callbacks(out: Path | None, overwrite: bool, progress: bool) -> list[Callback]:
    """The callbacks of a run written to ``out`` (none without it), in the order they must
    run: the folder, per-round weights, partition statistics, plots, trackers; and a
    progress bar."""
    cbs: list[Callback] = [RunFolder(out, overwrite), SaveWeights(out), PartitionStats(out),
                           PlotRun(out), Tracking(out)] if out is not None else []
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


def run_in_folder(exp: Experiment, out: Path) -> dict:
    """``exp.run()`` writing ``out`` (whose lock the caller holds); a diverged run's message
    says what the folder keeps."""
    try:
        return exp.run()
    except Diverged as e:
        saved = next(cb.saved for cb in exp.callbacks if isinstance(cb, RunFolder))
        kept = (f"{out} keeps its checkpoint of round {saved}" if saved else
                f"{out} has no checkpoint yet (start again with --overwrite)")
        raise Diverged(f"{e}; {kept}") from None


def run_experiment(cfg: Config, out: str | Path | None = None, *, overwrite: bool = False,
                   progress: bool = False, callbacks: Sequence[Callback] = ()) -> dict:
    """Run ``cfg`` to the end, writing a run folder at ``out`` if given (held locked against
    a second writer); ``callbacks`` are added to the default ones. Returns the summary."""
    out = Path(out) if out is not None else None
    exp = runnable(Experiment(cfg), out)
    exp.callbacks += [*folder_callbacks(out, overwrite, progress), *callbacks]
    if out is None:
        return exp.run()
    with runfolder.lock(out):
        return run_in_folder(exp, out)


def resume_experiment(out: str | Path, rounds: int | None = None, progress: bool = False,
                      callbacks: Sequence[Callback] = (), device: str | None = None) -> dict:
    """Continue a killed run from its last checkpoint; it ends as an uninterrupted run would.
    ``rounds`` extends a run to more rounds than it was configured for; ``device`` trains the
    rest elsewhere (checkpoints are device-independent)."""
    out = Path(out)
    if not (out / runfolder.CONFIG).is_file():  # before the lock, which would create the folder
        raise ProtoflError(f"{out} is not a run folder (no {runfolder.CONFIG}): nothing to "
                           "resume")
    with runfolder.lock(out):
        cfg = config_from_dict(runfolder.load_config_json(out))
        snapshot = runfolder.load_checkpoint(out)
        if rounds is not None:
            cfg = dataclasses.replace(cfg, rounds=rounds)
        if device is not None:
            cfg = config_from_dict({**cfg.to_dict(), "device": device})
        exp = runnable(Experiment(cfg), out)
        exp.callbacks += [*folder_callbacks(out, False, progress), *callbacks]
        exp.resume(out, snapshot)
        return run_in_folder(exp, out)


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
    """A Config from a Config, a mapping with the YAML's keys, or a YAML/JSON file's path."""
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, dict):
        return config_from_dict(config)
    return config_from_dict(load_raw(config))


def run(config: Config | dict | str | Path | None = None, out: str | Path | None = None, *,
        overwrite: bool = False, progress: bool = False,
        callbacks: Sequence[Callback] = ()) -> Run:
    """Run ``config`` (a Config, a dict with the YAML's keys or a config file's path) to the
    end, writing a run folder at ``out`` if given; returns the :class:`Run`."""
    records = Records()
    exp = runnable(Experiment(as_config(config)), None if out is None else Path(out))
    exp.callbacks += [*folder_callbacks(None if out is None else Path(out), overwrite,
                                        progress), records, *callbacks]
    if out is None:
        summary = exp.run()
    else:
        with runfolder.lock(Path(out)):
            summary = run_in_folder(exp, Path(out))
    return Run(exp.cfg, records.rows, summary, None if out is None else Path(out), exp)
