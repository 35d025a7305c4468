"""What both Flower apps build from a run: the protofl Config, and (cached per process) a
node's :class:`Node`: the run's Federation (data, model, algorithm, local setup) and its
aggregation layers, whose client hook makes an upload the node's contribution. A node never
builds the round loop, and imports nothing a run config names (callbacks run on the server).

Every deployment message runs in a fresh ``flwr-clientapp`` process, so a node's data are
built once per machine and memory-mapped by the later messages (``data.cache.mapped``; the
node config ``data-cache=false`` turns it off): the same files, one decode. Ray's workers in a
simulation map one copy of the dataset the same way."""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from typing import Any

import torch

from protofl import device as devices
from protofl.config import Config, apply_set, config_from_dict, load_raw
from protofl.data import cache as data_cache
from protofl.data.federated import FederatedData
from protofl.data.registry import load_dataset
from protofl.data.site import SITE, site_data
from protofl.engine.aggregation import Aggregation
from protofl.engine.federation import Federation, build
from protofl.engine.private import stack
from protofl.engine.spec import resolve_data
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


@dataclass
class Node:
    """What a SuperNode holds of a run: its Federation and aggregation layers."""

    fed: Federation
    aggregation: Aggregation


def node_of(cfg: Config, data: FederatedData | None = None) -> Node:
    fed = build(cfg, data, holds_clients=False)
    torch.set_num_threads(fed.spec.threads)  # the node process is the run's
    devices.set_deterministic(fed.spec.deterministic)
    return Node(fed, stack(fed.spec, fed.alg, fed.data.num_clients, fed.state))


@functools.lru_cache(maxsize=2)
def build_shared(cfg_json: str, data_root: str = "", cache: bool = True) -> Node:
    """The Node of a config (JSON of ``Config.to_dict()``), built once per process, so a
    ClientApp's data, model (wrapped by the algorithm), algorithm and local setup are built
    exactly as the engine builds them; ``data_root`` replaces ``data.root`` (a SuperNode's
    own copy of the dataset files); ``cache``: the data mapped from the machine's cache."""
    raw = json.loads(cfg_json)
    if data_root:
        raw["data"]["root"] = data_root
    cfg = config_from_dict(raw)
    spec = resolve_data(cfg.data)
    data = data_cache.mapped("node", {"data": asdict(spec)}, spec.root,
                        lambda: load_dataset(spec, lean=True)) if cache else None
    return node_of(cfg, data)


@functools.lru_cache(maxsize=4)  # a simulation worker may host several sites
def build_site(cfg_json: str, data_root: str, data_name: str, site: int,
               cache: bool = True) -> Node:
    """Site mode (``data.name: site``): the Node whose data are its own files at
    ``data_root`` (format ``data_name``, else ``data.site_format``) as client ``site``,
    checked against the agreed classes and input shape; built once per process
    (``cache``: once per machine, then mapped)."""
    cfg = config_from_dict(json.loads(cfg_json))
    fmt = data_name or cfg.data.site_format

    def files() -> FederatedData:
        return site_data(cfg.data, fmt, data_root, site)

    key = {"data": asdict(cfg.data), "format": fmt, "site": site}
    return node_of(cfg, data_cache.mapped("site", key, data_root, files) if cache else files())


def node_build(cfg_json: str, data_root: str, data_name: str, site: int,
               cache: bool = True) -> Node:
    """A node's Node: :func:`build_site` in site mode, else :func:`build_shared` (one copy
    of the dataset for every virtual node of a simulation worker)."""
    if json.loads(cfg_json).get("data", {}).get("name") == SITE:
        return build_site(cfg_json, data_root, data_name, site, cache)
    return build_shared(cfg_json, data_root, cache)


def check_partitions(num_partitions: int, data: FederatedData) -> None:
    if num_partitions != data.num_clients:
        raise ProtoflError(
            f"flower: num-partitions = {num_partitions} but {data.name} has {data.num_clients} "
            f"clients; run one SuperNode per client (num-supernodes = {data.num_clients}) or "
            f"set data.num_clients = {num_partitions}")
