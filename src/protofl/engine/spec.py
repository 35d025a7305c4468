"""The one resolver: a config becomes a :class:`RunSpec`, every default filled in one pass.

Defaults are *declared* where they belong (a dataset's partition, augmentation and model in
``data/registry.py``, DeepLab's sizes in ``models/registry.py``, an algorithm's options and
its paper's local-training settings in its class, each option's fallback in ``config.py``);
they are *filled* here only. ``config.json`` is the spec, and resolving a spec again changes
nothing (a resumed run and a Flower node resolve what the server wrote)::

    data = load_dataset(resolve_data(cfg.data), lean=True)
    spec = resolve(cfg, data)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from protofl import plugins, sizes
from protofl.algorithms.registry import ALGORITHMS, ALIASES, algorithm_class, algorithm_names
from protofl.config import Config, DataConfig, ModelConfig, build, declared
from protofl.data.federated import FederatedData
from protofl.data.partition import SCHEMES, check_scheme
from protofl.data.registry import DATASETS, DatasetSpec, dataset_spec, dataset_task
from protofl.engine import hetero
from protofl.engine.schedule import step_budget
from protofl.engine.trainers import TRAINERS, resolve_workers, trainer_class, usable_cores
from protofl.errors import ProtoflError
from protofl.models.families import HEAD_SEP, member_names
from protofl.models.registry import DEEPLAB_KEYS, MODELS, build_model, check_model_config

SMALL_MODEL = 1_000_000  # parameters: below this, one thread is fastest (no sync overhead)


class RunSpec(Config):
    """A resolved config: what ``config.json`` holds and what a run is built from."""


def fill(section: Any, defaults: dict[str, Any]) -> Any:
    """``section`` (an option dataclass) with each null option that has a ``fallback`` set to
    ``defaults[name]`` (an algorithm's paper setting) or else to its fallback."""
    values = {name: defaults.get(name, rule.fallback)
              for name, _, _, rule in declared(type(section))
              if rule is not None and rule.fallback is not None and getattr(section, name) is None}
    return dataclasses.replace(section, **values)


def resolve_data(data: DataConfig, spec: DatasetSpec | None = None) -> DataConfig:
    """The data section with the dataset's own partition, augmentation and default root
    filled in (what ``load_dataset`` reads); ``spec``: the dataset's entry, when the caller
    has it."""
    spec = spec or dataset_spec(data.name)
    check_scheme(data.partition)
    return dataclasses.replace(data, partition=data.partition or spec.partition,
                               augment=data.augment or spec.augment,
                               root=data.root or spec.root or data.root)


def resolve_model(cfg: Config, spec: DatasetSpec | None = None) -> ModelConfig:
    """The model section naming the model built: ``auto`` is the dataset's paper model, and
    DeepLab's null sizes are the dataset's, else DeepLab's defaults (checked where the model
    is first built, ``meta_algorithm``)."""
    spec = spec or dataset_spec(cfg.data.name)
    name = cfg.model.name if cfg.model.name != "auto" else spec.model
    if not name:
        raise ProtoflError(f"dataset {cfg.data.name!r} names no model of its own: set "
                           "model.name (`protofl models` lists them)")
    model = dataclasses.replace(cfg.model, name=name)
    if name == "deeplabv3plus":
        model = dataclasses.replace(model, **{
            k: spec.model_options.get(k, v) for k, v in DEEPLAB_KEYS.items()
            if getattr(model, k) is None})
    return model


def check_task(cfg: Config, spec: DatasetSpec | None = None) -> str:
    """The run's task (the dataset's; ``cfg.task``, when set, must agree), and that the
    algorithm is written for it: one-line errors otherwise."""
    task = dataset_task(cfg.data.name, cfg.task, spec)
    cls = algorithm_class(cfg.algorithm)
    if task not in cls.tasks:
        fit = [n for n in algorithm_names() if task in algorithm_class(n).tasks]
        raise ProtoflError(f"algorithm {cls.name!r} supports {' and '.join(cls.tasks)} only, "
                           f"not {task} ({cfg.data.name}); {task} algorithms: {', '.join(fit)}")
    return task


def meta_algorithm(spec: Config, data: FederatedData):
    """The run's algorithm with its model(s) built on the meta device (no memory, no weights
    file read, no random draw); for a heterogeneous run also its resolved model section. A
    size beyond what torch can count (over 2^63 bytes) is one line naming its key."""
    try:
        return _meta_algorithm(spec, data)
    except RuntimeError as e:
        if "overflow" not in str(e):
            raise
        key, value = size_source(spec, data, sizes.OVERFLOW)
        raise ProtoflError(f"config: {key} = {value}: the model's tensors would take more "
                           f"than 2^63 bytes (torch cannot count them); lower {key}") from None


def _meta_algorithm(spec: Config, data: FederatedData):
    plain = not hetero.requested(spec.model)
    if plain:
        check_model_config(spec.model)  # before pretrained is dropped: it reads it
    spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, pretrained=None))
    with torch.device("meta"):
        if not plain:
            return hetero.make(spec, data)
        model = build_model(spec.model.name, data.input_shape, data.num_classes, spec.model)
        return algorithm_class(spec.algorithm)(spec.algo, model, data.num_classes), spec.model


def check_sizes(spec: RunSpec, data: FederatedData, train_data: FederatedData,
                device: torch.device | str, holds_clients: bool = True) -> None:
    """Refuse, with one line naming the key and the bytes, a run whose model, server state,
    uploads, batch schedule, batches or confusion matrix cannot fit the memory of ``device``
    (and the host): sized from its algorithm built on the meta device, before anything is
    allocated (``protofl/sizes.py``; ``holds_clients``: ``sizes.model_bytes``)."""
    alg, _ = meta_algorithm(spec, data)
    total = sizes.model_bytes(alg, spec, hetero.init_state)
    sizes.check(sizes.run_needs(spec, data, train_data, alg,
                                lambda: size_source(spec, data, total), hetero.init_state,
                                holds_clients),
                device)


def size_source(spec: RunSpec, data: FederatedData, nbytes: int) -> tuple[str, object]:
    """The key (and its value) a model of ``nbytes`` (``sizes.model_bytes``) owes its size to:
    the set option whose default shrinks it most; else the data (its classes and inputs)."""
    cls = algorithm_class(spec.algorithm)
    defaults = {name: default for name, _, default, _ in declared(cls.Options)}
    candidates = [(f"model.{k}", getattr(spec.model, k), dataclasses.replace(
        spec, model=dataclasses.replace(spec.model, **{k: None})))
        for k in ("feature_dim", "seg_channels", "width") if getattr(spec.model, k)]
    candidates += [(f"algo.{k}", v, dataclasses.replace(spec, algo={**spec.algo,
                                                                    k: defaults[k]}))
                   for k, v in spec.algo.items()
                   if isinstance(v, int | float) and not isinstance(v, bool)
                   and k in defaults and v != defaults[k]]
    if spec.clients.per_round > 1:
        candidates.append(("clients.per_round", spec.clients.per_round, dataclasses.replace(
            spec, clients=dataclasses.replace(spec.clients, per_round=1))))
    best, found = 0, None
    for key, value, other in candidates:
        try:
            smaller = nbytes - sizes.model_bytes(_meta_algorithm(other, data)[0], other,
                                                 hetero.init_state)
        except Exception:  # noqa: BLE001 - a default that does not build names nothing
            continue
        if smaller > best:
            best, found = smaller, (key, value)
    if found is not None:
        return found
    where = spec.data.root or spec.data.name
    return ("data.root" if spec.data.root else "data.name",
            f"{where} ({data.num_classes} classes, inputs {tuple(data.input_shape)})")


BUILTIN_ALGORITHMS = {**ALGORITHMS, **{a: ALGORITHMS[n] for a, n in ALIASES.items()}}


def plugin_origins(cfg: Config) -> dict[str, dict[str, Any]]:
    """Where each plugin ``cfg`` names comes from, by config key (``Config.plugins``)."""
    named = [("algorithm", "algorithm", cfg.algorithm, BUILTIN_ALGORITHMS),
             ("dataset", "data.name", cfg.data.name, DATASETS),
             ("trainer", "trainer", cfg.trainer, {"auto": "", **TRAINERS}),
             ("model", "model.name", cfg.model.name, {"auto": "", hetero.NAME: "", **MODELS})]
    if cfg.data.partition is not None:
        named.append(("partition", "data.partition", cfg.data.partition,
                      dict.fromkeys(SCHEMES, "")))
    named += [("model", f"model.per_client[{i}]", name.partition(HEAD_SEP)[0],
               dict.fromkeys(member_names(), "")) for i, name in enumerate(cfg.model.per_client)]
    named += [("callback", f"callbacks[{i}]", name, {}) for i, name in enumerate(cfg.callbacks)]
    out = {}
    for kind, key, name, builtins in named:
        where = plugins.origin(kind, name, builtins)
        if where is not None:
            out[key] = where
    return out


def auto_threads(parameters: int) -> int:
    """Torch threads for a run: 1 for small models, whose operations are too short to share
    (more threads only spin, badly so when anything else runs); half the usable cores else."""
    return 1 if parameters < SMALL_MODEL else max(1, usable_cores() // 2)


def resolve(cfg: Config, data: FederatedData) -> RunSpec:
    """``cfg`` with every default filled for a run on ``data`` (the federation it names):
    the dataset's partition, augmentation and model; the algorithm's canonical name and
    options and the ``data.*`` settings it implies; the clients' settings (the config's, else
    the paper's, else the fallbacks; DP samples uniformly); threads, workers and the client
    count; and for pooled data (the centralized baseline), one client taking a federated
    round's expected SGD steps each round."""
    dataset = dataset_spec(cfg.data.name)  # looked up once, read three times
    task = check_task(cfg, dataset)
    hetero.check(cfg)
    if cfg.metrics.early_stop and not cfg.data.validation_fraction:
        raise ProtoflError("config: metrics.early_stop needs data.validation_fraction > 0 "
                           "(the held-out split it reads)")
    if cfg.trainer != "auto":
        trainer_class(cfg.trainer)  # a name the registry has
        if cfg.trainer_plan:
            raise ProtoflError(f"config: trainer_plan replays trainer auto's choices; it "
                               f"needs trainer: auto, not {cfg.trainer!r}")
    cls = algorithm_class(cfg.algorithm)
    data_cfg = dataclasses.replace(resolve_data(cfg.data, dataset), num_clients=data.num_clients,
                                   **cls.data_defaults)
    augment = data_cfg.augment
    if augment != "none" and len(data.input_shape) != 3:
        raise ProtoflError(f"config: data.augment = {augment} needs images (C, H, W); "
                           f"{data.name} rows are {data.input_shape}")
    paper = dict(cls.client_defaults)
    if cfg.privacy.noise_multiplier > 0 and cfg.clients.sampling is None:
        paper["sampling"] = "uniform"  # DP cannot account for size-weighted sampling
    clients = fill(cfg.clients, paper)
    if clients.per_round > data.num_clients:
        raise ProtoflError(f"config: clients.per_round = {clients.per_round} exceeds the "
                           f"{data.num_clients} clients of {data.name}")
    if data_cfg.pooled:
        budget = step_budget(data.train_sizes, clients.per_round, clients.local_epochs,
                             clients.local_steps, clients.batch_size)
        clients = dataclasses.replace(clients, per_round=1, local_steps=budget, stragglers=0.0)
    spec = RunSpec(**{**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(Config)},
                      "algorithm": cls.name if cfg.algorithm in BUILTIN_ALGORITHMS else (
                          cfg.algorithm),
                      "task": task,
                      "algo": dataclasses.asdict(build(cls.Options, dict(cfg.algo), "algo")),
                      "workers": resolve_workers(cfg.workers),
                      "data": data_cfg, "clients": clients,
                      "model": (cfg.model if hetero.requested(cfg.model) else
                                resolve_model(cfg, dataset)),
                      "metrics": fill(cfg.metrics, {"save_weights": data_cfg.pooled})})
    spec = dataclasses.replace(spec, plugins=plugin_origins(spec))
    if spec.threads is not None and not hetero.requested(spec.model):
        return spec
    alg, model = meta_algorithm(spec, data)
    spec = dataclasses.replace(spec, model=dataclasses.replace(
        model, pretrained=spec.model.pretrained))  # a heterogeneous run's groups named
    if spec.threads is None:
        parameters = sum(p.numel() for p in alg.model.parameters())
        spec = dataclasses.replace(spec, threads=auto_threads(parameters))
    return spec
