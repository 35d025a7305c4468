"""The typed, validated experiment config.

A config is a YAML/JSON mapping with the sections below; every key is checked up front and
a wrong one stops the run with one line naming it and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from protofl.errors import ProtoflError


@dataclass
class DataConfig:
    name: str = "synthetic"
    seed: int = 0  # the partition's seed: fixed across run seeds, so seeds vary training only
    root: str | None = None  # folder holding the files of a real dataset
    num_clients: int | None = None  # None: the dataset's own default
    partition: str | None = None  # iid | classes | dirichlet | dirichlet_powerlaw
    alpha: float = 0.5  # Dirichlet concentration
    gamma: float = 3.0  # power-law exponent of client sizes
    classes_per_client: int = 2
    synthetic_alpha: float = 1.0
    synthetic_beta: float = 1.0
    local_test_fraction: float = 0.1
    image_size: int | None = None  # resize images (medical sets); None: the dataset's default
    max_samples: int | None = None  # cap the pool (quick experiments on big sets)


@dataclass
class ModelConfig:
    name: str = "auto"  # auto: the dataset's paper model
    norm: str = "group"  # ResNet normalisation: group | batch
    pretrained: str | None = None  # local weights file


@dataclass
class ClientConfig:
    per_round: int = 10  # K'
    local_epochs: int = 1  # E
    local_steps: int | None = None  # if set, this many batches per round instead of epochs
    batch_size: int = 10
    optimizer: str = "sgd"  # sgd | adam
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    stragglers: float = 0.0  # delta: fraction of active clients doing partial work
    tolerate_partial: bool | None = None  # None: the algorithm's default
    sampling: str | None = None  # weighted | uniform; None: the algorithm's default


@dataclass
class MetricsConfig:
    dissimilarity_clients: int = 30  # gradient dissimilarity over this many clients (0: off)
    amm: bool = True
    train_loss_samples: int = 20000  # training loss of the aggregate model on up to this many
    eval_batch: int = 2048


@dataclass
class Config:
    algorithm: str = "fedmargin"
    seed: int = 0
    rounds: int = 50
    eval_every: int = 1
    checkpoint_every: int = 10
    trainer: str = "auto"  # auto | sequential | vectorized
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    clients: ClientConfig = field(default_factory=ClientConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    algo: dict[str, Any] = field(default_factory=dict)  # the algorithm's own options

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def check(self) -> Config:
        """Range checks that need no registry; algorithm and dataset names are checked where
        they are looked up."""
        c = self.clients
        _need(self.rounds >= 1, "rounds", self.rounds, "an integer >= 1")
        _need(self.eval_every >= 1, "eval_every", self.eval_every, "an integer >= 1")
        _need(self.checkpoint_every >= 0, "checkpoint_every", self.checkpoint_every, ">= 0")
        _need(self.trainer in ("auto", "sequential", "vectorized"), "trainer", self.trainer,
              "auto, sequential or vectorized")
        _need(c.per_round >= 1, "clients.per_round", c.per_round, "an integer >= 1")
        _need(c.local_epochs >= 1, "clients.local_epochs", c.local_epochs, "an integer >= 1")
        _need(c.local_steps is None or c.local_steps >= 1, "clients.local_steps",
              c.local_steps, "null or an integer >= 1")
        _need(c.batch_size >= 1, "clients.batch_size", c.batch_size, "an integer >= 1")
        _need(c.optimizer in ("sgd", "adam"), "clients.optimizer", c.optimizer, "sgd or adam")
        _need(c.lr > 0, "clients.lr", c.lr, "a number > 0")
        _need(0 <= c.momentum < 1, "clients.momentum", c.momentum, "a number in [0, 1)")
        _need(0 <= c.stragglers < 1, "clients.stragglers", c.stragglers, "a number in [0, 1)")
        _need(c.sampling in (None, "weighted", "uniform"), "clients.sampling", c.sampling,
              "weighted or uniform")
        _need(0 <= self.data.local_test_fraction < 1, "data.local_test_fraction",
              self.data.local_test_fraction, "a number in [0, 1)")
        _need(self.data.num_clients is None or self.data.num_clients >= 1, "data.num_clients",
              self.data.num_clients, "an integer >= 1")
        _need(self.metrics.dissimilarity_clients >= 0, "metrics.dissimilarity_clients",
              self.metrics.dissimilarity_clients, ">= 0")
        return self


def _need(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ProtoflError(f"config: {key} = {value!r} is out of range; allowed: {allowed}")


def _build(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ProtoflError(f"config: {where or 'the config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in fields:
            allowed = ", ".join(sorted(fields))
            raise ProtoflError(f"config: unknown key {path!r}; allowed: {allowed}")
        kwargs[key] = _coerce(hints[key], value, path)
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
        origin = typing.get_origin(hint)
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtoflError(f"config: {path} must be a mapping, got {value!r}")
        return dict(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    name = getattr(hint, "__name__", str(hint))
    raise ProtoflError(f"config: {path} = {value!r} should be of type {name}")


def config_from_dict(raw: dict[str, Any]) -> Config:
    return _build(Config, raw, "").check()


def load_raw(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON config file into a mapping (one clear error when unreadable)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ProtoflError(f"config file {p}: {e.strerror or e}") from None
    try:
        raw = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ProtoflError(f"config file {p} is not valid YAML/JSON: {first}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ProtoflError(f"config file {p} must hold a mapping at the top level")
    return raw


def apply_set(raw: dict[str, Any], assignment: str) -> None:
    """Apply one ``--set section.key=value`` (value parsed as YAML) to a raw config mapping."""
    if "=" not in assignment:
        raise ProtoflError(f"--set {assignment!r}: expected KEY=VALUE")
    key, text = assignment.split("=", 1)
    parts = key.strip().split(".")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ProtoflError(f"--set {key}: {part} is not a section")
    node[parts[-1]] = value


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge two raw config mappings (``over`` wins)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
