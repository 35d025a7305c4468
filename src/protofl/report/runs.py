"""A finished run rebuilt from its folder: the resolved config's Experiment (data, model,
algorithm) with the last checkpoint's state, for figures drawn after the run (t-SNE, the
segmentation figure)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from protofl.engine.runfolder import RunStore

if TYPE_CHECKING:
    from protofl.engine.experiment import Experiment


def restored(folder: Path) -> Experiment:
    """The run in ``folder`` as it stood at its last checkpoint (the store reads it, the loop
    restores it: ``engine.experiment.restored``)."""
    from protofl.engine import experiment

    return experiment.restored(RunStore(folder))


def summary_line(summary: dict, out: Path | None = None) -> str:
    """A finished run in one line: ``fedmargin on digits, 40 rounds: accuracy 0.73, ...
    (15.0 s) -> OUT`` (what ``protofl run`` and the Flower ServerApp print at the end)."""
    figures = ", ".join(f"{k} {summary[k]:.4f}" for k in ("miou", "accuracy", "loss",
                                                          "local_accuracy")
                        if isinstance(summary.get(k), float))
    if isinstance(summary.get("epsilon"), float):
        figures += f", epsilon {summary['epsilon']:.3g}"
    stopped = f", stopped early: {summary['stopped']}" if summary.get("stopped") else ""
    where = f" -> {out}" if out is not None else ""
    return (f"{summary['algorithm']} on {summary['dataset']}, {summary['rounds']} rounds: "
            f"{figures} ({summary['seconds']:.1f} s{stopped}){where}")
