"""The Python API for notebooks and scripts: run, resume and compare experiments.

    from protofl import config_from_dict, run_experiment
    summary = run_experiment(config_from_dict({"algorithm": "fedmargin", "rounds": 20}),
                             out="runs/demo")
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

from protofl.config import Config, config_from_dict
from protofl.data.site import SiteFederation
from protofl.engine import runfolder
from protofl.engine.callbacks import Callback, Progress, RunFolder, SaveWeights
from protofl.engine.experiment import Experiment
from protofl.errors import Diverged, ProtoflError
from protofl.report.plots import PlotRun
from protofl.report.stats import PartitionStats
from protofl.report.trackers import Tracking, require

log = logging.getLogger("protofl")


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
    ``rounds`` is the run's new total: more than configured extends it, fewer (never below the
    checkpoint's round) ends it sooner, with a warning; ``device`` trains the rest elsewhere
    (checkpoints are device-independent)."""
    out = Path(out)
    if not (out / runfolder.CONFIG).is_file():  # before the lock, which would create the folder
        raise ProtoflError(f"{out} is not a run folder (no {runfolder.CONFIG}): nothing to "
                           "resume")
    with runfolder.lock(out):
        cfg = config_from_dict(runfolder.load_config_json(out))
        snapshot = runfolder.load_checkpoint(out)
        if rounds is not None:
            if rounds < cfg.rounds:
                log.warning("--rounds %d is fewer than the %d configured: the run ends sooner, "
                            "at round %d", rounds, cfg.rounds, rounds)
            cfg = dataclasses.replace(cfg, rounds=rounds)
        if device is not None:
            cfg = config_from_dict({**cfg.to_dict(), "device": device})
        exp = runnable(Experiment(cfg), out)
        runfolder.check_resumable(out, snapshot, exp.alg.name, exp.state)
        exp.callbacks += [*folder_callbacks(out, False, progress), *callbacks]
        exp.resume(out, snapshot)
        return run_in_folder(exp, out)
