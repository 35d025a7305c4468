"""Model-heterogeneous federations in the engine: client k trains the model of its group
(``models/families.py``), and only prototypes travel.

An algorithm supports this when it is ``capabilities.Personalized`` (it uploads no weights and
keeps each client's model in its client state), or ``algorithms/registry.py:HETEROGENEOUS``
names a variant of it that is (fedproin's ``PersonalFedProIn``). Such an algorithm keeps the
clients' common initial weights under ``init`` in its state and broadcast. In a
heterogeneous federation ``init`` holds one entry per model group (``m0``, ``m1``, ...), and
each group sees the algorithm, state and broadcast of its own model (``view``,
``group_state``): the algorithm's code is the same as with one model.

Trainers: :class:`GroupedTrainer` splits a round's jobs by group and hands each group to an
ordinary trainer (so the vectorized trainer stacks, with ``vmap``, the clients of one model);
the parallel trainer's workers each wrap their own trainer so (``grouped``).
"""

from __future__ import annotations

import copy
import dataclasses

from protofl.algorithms.base import Algorithm, FederationInfo, Tensors, split_state
from protofl.algorithms.capabilities import personalized
from protofl.algorithms.registry import algorithm_class, heterogeneous_variant, make_algorithm
from protofl.config import Config, ModelConfig
from protofl.data.federated import FederatedData
from protofl.engine.train import ClientResult, RoundContext, Trainer
from protofl.errors import ProtoflError
from protofl.metrics import federated as fm
from protofl.models.families import ModelGroups, build_groups

NAME = "heterogeneous"  # the resolved model.name of a heterogeneous federation


def requested(model: ModelConfig) -> bool:
    return bool(model.per_client or model.family)


def variant(name: str) -> type[Algorithm]:
    """The class that runs algorithm ``name`` on heterogeneous models; one line why not."""
    cls = algorithm_class(name)
    if personalized(cls):
        return cls
    other = heterogeneous_variant(name)
    if other is None:
        why = cls.heterogeneous_reason or "its server averages model weights"
        raise ProtoflError(f"algorithm {cls.name!r} cannot train heterogeneous models "
                           f"(model.per_client / model.family): {why}; use one of "
                           f"{', '.join(capable())}")
    return other


def capable() -> list[str]:
    """The registered algorithms that train heterogeneous models."""
    from protofl.algorithms.registry import HETEROGENEOUS, algorithm_names

    return [n for n in algorithm_names()
            if n in HETEROGENEOUS or personalized(algorithm_class(n))]


def check(cfg: Config) -> None:
    """Refuse, before anything is loaded, what a heterogeneous run cannot do."""
    if not requested(cfg.model):
        return
    variant(cfg.algorithm)
    if cfg.metrics.ffd_reference:
        raise ProtoflError("config: metrics.ffd_reference compares with one reference model; "
                           "a heterogeneous federation has several")


def key(group: int) -> str:
    return f"m{group}"


def groups_of(alg: Algorithm) -> ModelGroups | None:
    return alg.groups


def make(cfg: Config, data: FederatedData, federation: FederationInfo | None = None
         ) -> tuple[Algorithm, ModelConfig]:
    """The algorithm of a heterogeneous run (``model`` = the first group's, ``groups`` = every
    group's, each wrapped by the algorithm) and the resolved model config (``name``
    ``heterogeneous``, ``per_client`` the list in use, ``feature_dim`` d)."""
    cls = variant(cfg.algorithm)
    groups, dim = build_groups(cfg.model, data.input_shape, data.num_classes)
    alg = cls(cfg.algo, groups.models[0], data.num_classes, federation)
    groups.models = [alg.model] + [alg.wrap_model(m) for m in groups.models[1:]]
    alg.groups = groups
    resolved = dataclasses.replace(cfg.model, name=NAME, per_client=list(groups.names),
                                   feature_dim=dim)
    return alg, resolved


def make_plain(cfg: Config, data: FederatedData, name: str, model_cfg: ModelConfig
               ) -> Algorithm:
    """The algorithm of a one-model run (as ``Experiment`` builds it)."""
    from protofl.models.registry import build_model

    model = build_model(name, data.input_shape, data.num_classes, model_cfg)
    return make_algorithm(cfg.algorithm, cfg.algo, model, data.num_classes)


def to_device(alg: Algorithm, device) -> None:
    for m in (groups_of(alg).models if groups_of(alg) else [alg.model]):
        m.to(device)


def init_state(alg: Algorithm) -> Tensors:
    """The algorithm's initial state; heterogeneous: ``init`` per group."""
    groups = groups_of(alg)
    state = alg.init_state(alg.model)
    if groups is None:
        return state
    inits = {}
    for g, m in enumerate(groups.models):
        params, buffers = split_state(m)
        inits[key(g)] = {"params": params, "buffers": buffers}
    return {**state, "init": inits}


def view(alg: Algorithm, group: int) -> Algorithm:
    """``alg`` as seen by one group: the same object's options and functions, its model."""
    cache = alg.__dict__.setdefault("_views", {})
    if group not in cache:
        v = copy.copy(alg)
        v.model = groups_of(alg).models[group]
        v.groups = None
        cache[group] = v
    return cache[group]


def group_state(tree: Tensors, group: int) -> Tensors:
    """A state or broadcast with ``init`` narrowed to the group's."""
    return {**tree, "init": tree["init"][key(group)]}


class GroupedTrainer:
    """``inner`` run once per model group present in the round (results in job order)."""

    def __init__(self, inner: Trainer):
        self.inner = inner
        self.name = inner.name

    def train(self, rc: RoundContext) -> list[ClientResult]:
        groups = groups_of(rc.alg)
        if groups is None:
            return self.inner.train(rc)
        by_group: dict[int, list] = {}
        for j in rc.jobs:
            by_group.setdefault(groups.of(j.client), []).append(j)
        out: dict[int, ClientResult] = {}
        for g, jobs in sorted(by_group.items()):
            sub = dataclasses.replace(rc, alg=view(rc.alg, g), jobs=jobs,
                                      broadcast=group_state(rc.broadcast, g))
            out.update((r.client, r) for r in self.inner.train(sub))
        return [out[j.client] for j in rc.jobs if j.client in out]

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


def grouped(trainer: Trainer, alg: Algorithm) -> Trainer:
    """``trainer`` split by model group where ``alg`` trains several models (the parallel
    trainer groups inside its workers instead)."""
    if groups_of(alg) is None or getattr(trainer, "groups_inside", False):
        return trainer
    return GroupedTrainer(trainer)


def client_predictions(alg: Algorithm, state: Tensors, data: FederatedData,
                       client_states: dict[int, Tensors], batch: int
                       ) -> dict[int, tuple]:
    """``metrics.federated.client_predictions`` with every client scored by its own model."""
    groups = groups_of(alg)
    if groups is None:
        return fm.client_predictions(alg, alg.model, state, data, client_states, batch)
    preds: dict[int, tuple] = {}
    for g in range(len(groups.models)):
        v = view(alg, g)
        preds.update(fm.client_predictions(v, v.model, group_state(state, g), data,
                                           client_states, batch,
                                           clients=groups.clients(g, data.num_clients)))
    return dict(sorted(preds.items()))


# ---- Flower: a node trains its own group's model, or the one its node config names ----
NODE_MODEL = "model"  # node-config key: the model this site trains (heterogeneous runs)


def node_config(cfg_json: str, model: str) -> str:
    """The run's config as a node that trains ``model`` (node config ``model``) builds it:
    one group of that model with the run's feature size ("": the run's config as it is)."""
    import json

    if not model:
        return cfg_json
    raw = json.loads(cfg_json)
    m = raw.get("model", {})
    if not (m.get("per_client") or m.get("family")):
        raise ProtoflError(f"flower: node config {NODE_MODEL}={model} needs a heterogeneous "
                           "run (model.per_client or model.family)")
    raw["model"] = {**m, "per_client": [model], "family": None}
    return json.dumps(raw, sort_keys=True)


def node_view(alg: Algorithm, node_state: Tensors, tree: Tensors, client: int,
              own_model: bool) -> tuple[Algorithm, Tensors]:
    """The algorithm and broadcast (or server state) a node's client trains and is scored
    with: its group's (the server sends a group's broadcast narrowed, its state whole), or,
    when the node names its own model, that model from the node's own initial weights."""
    groups = groups_of(alg)
    if groups is None:
        return alg, tree
    g = 0 if own_model else groups.of(client)
    init = tree["init"]
    if own_model:
        init = node_state["init"][key(0)]
    elif "params" not in init:  # every group's: pick this one
        init = init[key(g)]
    return view(alg, g), {**tree, "init": init}
