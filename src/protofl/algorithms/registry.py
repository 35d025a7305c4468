"""Algorithms by name (``pgfl`` is an alias of ``fedmargin``)."""

from __future__ import annotations

import importlib
from typing import Any

from protofl.algorithms.base import Algorithm, FederationInfo
from protofl.errors import ProtoflError
from protofl.models.nets import ProtoNet

ALGORITHMS: dict[str, str] = {
    "fedavg": "protofl.algorithms.fedavg:FedAvg",
    "fedprox": "protofl.algorithms.fedavg:FedProx",
    "fedatt": "protofl.algorithms.fedavg:FedAtt",
    "fedmargin": "protofl.algorithms.fedmargin:FedMargin",
    "fedproin": "protofl.algorithms.fedproin:FedProIn",
    "moon": "protofl.algorithms.moon:Moon",
    "fedproto": "protofl.algorithms.fedproto:FedProto",
    "fedtgp": "protofl.algorithms.fedtgp:FedTGP",
    "fedplvm": "protofl.algorithms.fedplvm:FedPLVM",
    "feddyn": "protofl.algorithms.feddyn:FedDyn",
    "fd": "protofl.algorithms.fd:FD",
    "lgfedavg": "protofl.algorithms.lgfedavg:LGFedAvg",
    "fedgh": "protofl.algorithms.fedgh:FedGH",
    "fedgen": "protofl.algorithms.fedgen:FedGen",
    "fpl": "protofl.algorithms.fpl:FPL",
    "fml": "protofl.algorithms.fml:FML",
    "fedkd": "protofl.algorithms.fedkd:FedKD",
    "fedmrl": "protofl.algorithms.fedmrl:FedMRL",
    "scaffold": "protofl.algorithms.scaffold:Scaffold",
    "fednova": "protofl.algorithms.fednova:FedNova",
    "fedadam": "protofl.algorithms.fedopt:FedAdam",
    "fedyogi": "protofl.algorithms.fedopt:FedYogi",
    "fedadagrad": "protofl.algorithms.fedopt:FedAdagrad",
    "central": "protofl.algorithms.central:Central",
}
ALIASES = {"pgfl": "fedmargin"}
# the variant that trains an algorithm on heterogeneous models (a model per client group),
# where it is another class: fedproin with personalised encoders, only prototypes aggregated
HETEROGENEOUS: dict[str, str] = {
    "fedproin": "protofl.algorithms.fedproin_personal:PersonalFedProIn",
    "fpl": "protofl.algorithms.fpl:PersonalFPL",
}


def heterogeneous_variant(name: str) -> type[Algorithm] | None:
    """The class registered in :data:`HETEROGENEOUS` for algorithm ``name`` (None: none)."""
    path = HETEROGENEOUS.get(ALIASES.get(name, name))
    if path is None:
        return None
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


def algorithm_class(name: str) -> type[Algorithm]:
    name = ALIASES.get(name, name)
    if name not in ALGORITHMS:
        allowed = ", ".join([*ALGORITHMS, *ALIASES])
        raise ProtoflError(f"unknown algorithm {name!r}; allowed: {allowed}")
    module, cls = ALGORITHMS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def make_algorithm(name: str, options: dict[str, Any], model: ProtoNet, num_classes: int,
                   federation: FederationInfo | None = None) -> Algorithm:
    return algorithm_class(name)(options, model, num_classes, federation)
