"""A finished run rebuilt from its folder: the resolved config's Experiment (data, model,
algorithm) with the last checkpoint's state, for figures drawn after the run (t-SNE, the
segmentation figure)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from protofl.engine import runfolder

if TYPE_CHECKING:
    from protofl.engine.experiment import Experiment


def restored(folder: Path) -> Experiment:
    """The run in ``folder`` as it stood at its last checkpoint."""
    from protofl.config import config_from_dict
    from protofl.engine.experiment import Experiment

    folder = Path(folder)
    exp = Experiment(config_from_dict(runfolder.load_config_json(folder)))
    exp.restore(runfolder.load_checkpoint(folder))
    return exp
