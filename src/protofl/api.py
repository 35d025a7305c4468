"""The Python API for notebooks and scripts: run, resume and compare experiments.

    from protofl import config_from_dict, run_experiment
    summary = run_experiment(config_from_dict({"algorithm": "fedmargin", "rounds": 20}),
                             out="runs/demo")
"""

from __future__ import annotations

from pathlib import Path

from protofl.config import Config, config_from_dict
from protofl.engine import runfolder
from protofl.engine.callbacks import Callback, Progress, RunFolder, SaveWeights
from protofl.engine.experiment import Experiment
from protofl.errors import ProtoflError
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


def _check(exp: Experiment, out: Path | None) -> None:
    """What can be refused before the run folder is touched."""
    if exp.cfg.tracking and out is None:
        raise ProtoflError("tracking needs a run folder (out)")
    require(exp.cfg.tracking)


def run_experiment(cfg: Config, out: str | Path | None = None, *, overwrite: bool = False,
                   progress: bool = False, callbacks: list[Callback] = ()) -> dict:
    """Run ``cfg`` to the end, writing a run folder at ``out`` if given; ``callbacks`` are
    added to the default ones. Returns the summary."""
    exp = Experiment(cfg)
    _check(exp, None if out is None else Path(out))
    exp.callbacks += [*folder_callbacks(Path(out) if out is not None else None, overwrite,
                                        progress), *callbacks]
    return exp.run()


def resume_experiment(out: str | Path, progress: bool = False,
                      callbacks: list[Callback] = ()) -> dict:
    """Continue a killed run from its last checkpoint; it ends as an uninterrupted run would."""
    out = Path(out)
    exp = Experiment(config_from_dict(runfolder.load_config_json(out)))
    _check(exp, out)
    exp.callbacks += [*folder_callbacks(out, False, progress), *callbacks]
    exp.restore(runfolder.load_checkpoint(out))
    return exp.run()
