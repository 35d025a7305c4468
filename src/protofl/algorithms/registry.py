"""Algorithms by name (``pgfl`` is an alias of ``fedmargin``), installed entry point
(``protofl.algorithms``) or import path (``package.module:Class``; ``protofl/plugins.py``)."""

from __future__ import annotations

import importlib
from typing import Any

from protofl import plugins
from protofl.algorithms.base import Algorithm, FederationInfo
from protofl.algorithms.contract import CONTRACT
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


def algorithm_names() -> list[str]:
    """The built-in algorithms, then those installed packages declare."""
    return plugins.names("algorithm", ALGORITHMS)


def algorithm_class(name: str) -> type[Algorithm]:
    """The class (or factory) algorithm ``name`` stands for, checked against the contract."""
    name = ALIASES.get(name, name)
    obj = plugins.load("algorithm", name, ALGORITHMS)
    if isinstance(obj, type):
        check_contract(obj, name)
    elif not callable(obj):
        raise ProtoflError(f"algorithm {name!r} is {type(obj).__name__}, not an Algorithm "
                           "class or a factory of one")
    return obj


def check_contract(cls: type, name: str) -> None:
    """One line unless ``cls`` is an Algorithm written for this protofl's hook contract."""
    if not issubclass(cls, Algorithm):
        raise ProtoflError(f"algorithm {name!r} ({plugins.path_of(cls)}) is not a subclass of "
                           "protofl.algorithms.base.Algorithm")
    if getattr(cls, "contract", None) != CONTRACT:
        raise ProtoflError(f"algorithm {name!r} is written for hook contract "
                           f"{getattr(cls, 'contract', None)}; this protofl runs contract "
                           f"{CONTRACT} (docs/architecture.md)")


def make_algorithm(name: str, options: dict[str, Any], model: ProtoNet, num_classes: int,
                   federation: FederationInfo | None = None) -> Algorithm:
    alg = algorithm_class(name)(options, model, num_classes, federation)
    check_contract(type(alg), name)
    return alg
