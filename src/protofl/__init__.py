"""protofl: prototype-guided federated learning (fedmargin, fedproin and their baselines).

The Python API (:mod:`protofl.api`) is importable from here: ``run`` (returns a ``Run``),
``run_experiment``, ``resume_experiment``, ``config_from_dict``, ``build`` (a
``Federation``), ``resolve`` (a ``RunSpec``), ``Experiment`` and ``Callback``; and what a
plugin is written against: ``Algorithm`` with its hook contexts ``ClientRound`` and
``TrainedClient`` (contract version ``CONTRACT``) and capabilities ``Sums``,
``Prototypes``, ``Personalized``; ``option`` (a declared option); ``ProtoNet`` (a model);
``DatasetSpec``, ``FederatedData``, ``from_partition`` and ``config_partition`` (a
dataset); ``ProtoflError`` (bad input: one line, exit 2). ``protofl.testing`` checks a
plugin against the contract.
"""

from __future__ import annotations

__version__ = "0.2.0"  # the release: pyproject.toml and CHANGELOG.md name it too (a test checks)

_API = {"run": "protofl.api", "Run": "protofl.api", "run_experiment": "protofl.api",
        "build": "protofl.api", "Federation": "protofl.engine.federation",
        "resolve": "protofl.engine.spec", "RunSpec": "protofl.engine.spec",
        "resume_experiment": "protofl.api",
        "config_from_dict": "protofl.config", "load_raw": "protofl.config",
        "Experiment": "protofl.engine.experiment", "Callback": "protofl.engine.callbacks",
        # what plugins are written against (docs/architecture.md)
        "Algorithm": "protofl.algorithms.base", "ClientRound": "protofl.algorithms.contract",
        "TrainedClient": "protofl.algorithms.contract", "CONTRACT": "protofl.algorithms.contract",
        "Sums": "protofl.algorithms.capabilities",
        "Prototypes": "protofl.algorithms.capabilities",
        "Personalized": "protofl.algorithms.capabilities", "option": "protofl.config",
        "ProtoNet": "protofl.models.nets", "DatasetSpec": "protofl.data.registry",
        "FederatedData": "protofl.data.federated", "from_partition": "protofl.data.federated",
        "config_partition": "protofl.data.partition", "ProtoflError": "protofl.errors"}


def __getattr__(name: str):  # imported on first use: `import protofl` stays light
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'protofl' has no attribute {name!r}")
