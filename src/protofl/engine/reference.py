"""Per-round weights of a run, and a reference run read back for the FFD metric.

A run with ``metrics.save_weights`` keeps its aggregate model after every round ``t`` in
``<run>/weights/round_{t:04d}.safetensors`` (the checkpoints' format: tensors and JSON, no
pickled code). :class:`Reference` opens such a run (e.g. ``protofl run --algorithm
central``) for a later run: it rebuilds the reference's model from its ``config.json`` and
hands out its weights of a given round, after checking that the two runs fit (same dataset,
same model, the rounds needed saved).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from protofl.algorithms.base import Weights, split_state
from protofl.algorithms.registry import make_algorithm
from protofl.config import Config, config_from_dict
from protofl.data.federated import FederatedData
from protofl.engine import runfolder, tensorfile
from protofl.errors import ProtoflError
from protofl.models.nets import ProtoNet
from protofl.models.registry import build_model
from protofl.seeding import PROBE, np_rng

WEIGHTS_DIR = runfolder.WEIGHTS_DIR
weights_path = runfolder.weights_path  # a run folder's round weights (RunStore writes them)
FFD_PROBE = 1  # third key of the probe generator: (data.seed, PROBE, FFD_PROBE)


def load_weights(path: Path) -> Weights:
    """The weights :func:`save_weights` wrote (anything else is refused with one line)."""
    try:
        tree = tensorfile.decode(Path(path).read_bytes())
    except FileNotFoundError:
        raise ProtoflError(f"{path} does not exist") from None
    except (OSError, ValueError) as e:  # torn or foreign file
        raise ProtoflError(f"{path} cannot be read as saved weights ({e})") from None
    if not (isinstance(tree, dict) and set(tree) == {"params", "buffers"} and all(
            isinstance(v, torch.Tensor) for part in tree.values() for v in part.values())):
        raise ProtoflError(f"{path} does not hold a model's weights")
    return {"params": tree["params"], "buffers": tree["buffers"]}


def probe(data: FederatedData, size: int, data_seed: int) -> torch.Tensor:
    """The FFD probe: ``size`` global-test inputs (as the model sees them) drawn with the data
    seed only, so every algorithm and run seed on the same data shares it."""
    n = len(data.y_test)
    idx = np.arange(n) if size >= n else np.sort(
        np_rng(data_seed, PROBE, FFD_PROBE).choice(n, size, replace=False))
    return data.inputs(data.x_test[torch.from_numpy(idx)])


class Reference:
    """A finished (or at least far enough) run with saved weights, opened for ``cfg``'s run
    (``model``: the model the run trains; ``data``: its data)."""

    def __init__(self, folder: Path, cfg: Config, model: ProtoNet, data: FederatedData):
        self.folder = folder = Path(folder)
        where = f"metrics.ffd_reference {folder}"
        if not (folder / runfolder.CONFIG).exists():
            raise ProtoflError(f"{where}: not a run folder (no {runfolder.CONFIG})")
        try:
            ref = config_from_dict(runfolder.load_config_json(folder))
        except ProtoflError as e:
            raise ProtoflError(f"{where}: {e}") from None
        if ref.data.name != cfg.data.name:
            raise ProtoflError(f"{where} ran on {ref.data.name!r}, this run on "
                               f"{cfg.data.name!r}: FFD compares features of the same data")
        if (ref.model.name, ref.model.norm) != (cfg.model.name, cfg.model.norm):
            raise ProtoflError(f"{where} trained model {ref.model.name!r} ({ref.model.norm} "
                               f"norm), this run {cfg.model.name!r} ({cfg.model.norm} norm): "
                               "FFD needs the same architecture")
        needed = runfolder.evaluated_rounds(cfg.rounds, cfg.eval_every, cfg.rounds)
        if ref.rounds < cfg.rounds:
            raise ProtoflError(f"{where} has {ref.rounds} rounds, this run needs the "
                               f"reference at round {cfg.rounds}")
        if not ref.metrics.save_weights:
            raise ProtoflError(f"{where} did not save its weights (run it with "
                               "metrics.save_weights: true; central does by default)")
        missing = [t for t in needed if not weights_path(folder, t).exists()]
        if missing:
            raise ProtoflError(f"{where} lacks {weights_path(folder, missing[0])} (and "
                               f"{len(missing) - 1} more): is that run unfinished?")
        with torch.random.fork_rng():  # building a model must not move this run's RNG
            plain = build_model(ref.model.name, data.input_shape, data.num_classes,
                                dataclasses.replace(ref.model, pretrained=None))
            self.model = make_algorithm(ref.algorithm, ref.algo, plain, data.num_classes).model
        dim = (getattr(self.model, "feature_dim", None), getattr(model, "feature_dim", None))
        if dim[0] != dim[1]:
            raise ProtoflError(f"{where}: features of {dim[0]} channels, this run's "
                               f"{dim[1]}: FFD needs the same architecture")
        self.shapes = {part: {k: tuple(v.shape) for k, v in tree.items()}
                       for part, tree in zip(("params", "buffers"), split_state(self.model))}
        self.weights(needed[0])  # fails now, not mid-run, when the files do not fit

    def weights(self, round: int) -> Weights:
        """The reference's aggregate weights after ``round``."""
        path = weights_path(self.folder, round)
        w = load_weights(path)
        got = {part: {k: tuple(v.shape) for k, v in w[part].items()} for part in w}
        if got != self.shapes:
            raise ProtoflError(f"metrics.ffd_reference: {path} does not fit the reference's "
                               "model (other input size or classes?)")
        return w
