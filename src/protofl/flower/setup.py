"""What both Flower apps build from a run: the protofl Config, and (cached per process) the
engine's Experiment holding the data, model and algorithm it names."""

from __future__ import annotations

import functools
import json
from typing import Any

from protofl.config import Config, apply_set, config_from_dict, load_raw
from protofl.data.federated import FederatedData
from protofl.data.site import SITE, site_data
from protofl.engine.experiment import Experiment
from protofl.errors import ProtoflError

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


@functools.lru_cache(maxsize=2)
def build(cfg_json: str, data_root: str = "", data_name: str = "", site: int = 0
          ) -> Experiment:
    """The in-process Experiment of a config (JSON of ``Config.to_dict()``), built once per
    process, so a ClientApp's data, model (wrapped by the algorithm), algorithm and local
    setup are built exactly as the engine builds them; ``data_root`` replaces ``data.root``
    (a SuperNode's own copy of the dataset files). In site mode (``data.name: site``) the
    data are the node's own files at ``data_root`` (format ``data_name``, else
    ``data.site_format``) as client ``site``, checked against the agreed classes and input
    shape."""
    raw = json.loads(cfg_json)
    if raw.get("data", {}).get("name") == SITE:
        cfg = config_from_dict(raw)
        fmt = data_name or cfg.data.site_format
        return Experiment(cfg, data=site_data(cfg.data, fmt, data_root, site))
    if data_root:
        raw["data"]["root"] = data_root
    return Experiment(config_from_dict(raw))


def check_partitions(num_partitions: int, data: FederatedData) -> None:
    if num_partitions != data.num_clients:
        raise ProtoflError(
            f"flower: num-partitions = {num_partitions} but {data.name} has {data.num_clients} "
            f"clients; run one SuperNode per client (num-supernodes = {data.num_clients}) or "
            f"set data.num_clients = {num_partitions}")
