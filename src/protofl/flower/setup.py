"""What both Flower apps build from a run: the protofl Config, and (cached per process) the
data, model and algorithm it names."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import torch

from protofl.algorithms.base import Algorithm
from protofl.algorithms.registry import make_algorithm
from protofl.config import Config, apply_set, config_from_dict, load_raw
from protofl.data.federated import FederatedData
from protofl.data.registry import dataset_spec, load_dataset
from protofl.engine.train import LocalSetup
from protofl.errors import ProtoflError
from protofl.models.nets import ProtoNet
from protofl.models.registry import build_model

# run-config keys (``[tool.flwr.app.config]`` in pyproject.toml, ``flwr run -c``)
CONFIG = "config"  # path to a protofl YAML/JSON config ("" = protofl's defaults)
SET = "set"  # ";"-separated section.key=value overrides, as the CLI's --set
ROUNDS = "num-server-rounds"  # > 0 overrides the config's rounds
OUT = "out"  # run folder the ServerApp writes ("" = none)


def config_from_run(run_config: dict[str, Any]) -> Config:
    """The protofl Config a Flower run config describes."""
    path = str(run_config.get(CONFIG, "") or "")
    raw = load_raw(path) if path else {}
    for item in str(run_config.get(SET, "") or "").split(";"):
        if item.strip():
            apply_set(raw, item.strip())
    rounds = int(run_config.get(ROUNDS, 0) or 0)
    if rounds > 0:
        raw["rounds"] = rounds
    return config_from_dict(raw)


@dataclass
class Built:
    """A config's data, model (architecture; weights travel in messages) and algorithm."""

    cfg: Config
    data: FederatedData
    model: ProtoNet
    alg: Algorithm
    setup: LocalSetup


def local_setup(cfg: Config) -> LocalSetup:
    c = cfg.clients
    return LocalSetup(c.batch_size, c.local_steps is not None, c.optimizer, c.lr, c.momentum,
                      c.weight_decay, cfg.seed)


@functools.lru_cache(maxsize=2)
def build(cfg_json: str, data_root: str = "") -> Built:
    """Data, model and algorithm of a config (JSON of ``Config.to_dict()``), built once per
    process; ``data_root`` replaces ``data.root`` (a SuperNode's own copy of the files)."""
    raw = json.loads(cfg_json)
    if data_root:
        raw["data"]["root"] = data_root
    cfg = config_from_dict(raw)
    data = load_dataset(cfg.data)
    name = cfg.model.name if cfg.model.name != "auto" else dataset_spec(cfg.data.name).model
    torch.manual_seed(cfg.seed)
    model = build_model(name, data.input_shape, data.num_classes, cfg.model)
    alg = make_algorithm(cfg.algorithm, cfg.algo, model, data.num_classes)
    return Built(cfg, data, model, alg, local_setup(cfg))


def check_partitions(num_partitions: int, data: FederatedData) -> None:
    if num_partitions != data.num_clients:
        raise ProtoflError(
            f"flower: num-partitions = {num_partitions} but {data.name} has {data.num_clients} "
            f"clients; run one SuperNode per client (num-supernodes = {data.num_clients}) or "
            f"set data.num_clients = {num_partitions}")
