"""protofl: prototype-guided federated learning (fedmargin, fedproin and their baselines).

The Python API (:mod:`protofl.api`) is importable from here: ``run`` (returns a ``Run``),
``run_experiment``, ``resume_experiment``, ``config_from_dict``, ``build`` (a
``Federation``), ``resolve`` (a ``RunSpec``), ``Experiment`` and ``Callback``.
"""

from __future__ import annotations

__version__ = "0.2.0"  # the release; pyproject.toml reads it (CHANGELOG.md names it)

_API = {"run": "protofl.api", "Run": "protofl.api", "run_experiment": "protofl.api",
        "build": "protofl.api", "Federation": "protofl.engine.federation",
        "resolve": "protofl.engine.spec", "RunSpec": "protofl.engine.spec",
        "resume_experiment": "protofl.api",
        "config_from_dict": "protofl.config", "load_raw": "protofl.config",
        "Experiment": "protofl.engine.experiment", "Callback": "protofl.engine.callbacks"}


def __getattr__(name: str):  # imported on first use: `import protofl` stays light
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'protofl' has no attribute {name!r}")
