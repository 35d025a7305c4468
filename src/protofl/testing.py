"""protofl's contract made executable, for your own pytest (as scikit-learn's ``check_estimator``).

Hand-worked tests of an algorithm's hooks build their contexts with :func:`client_round` and
:func:`trained`; the ``check_*`` functions run the shared checks every built-in algorithm,
model, dataset and partition passes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from protofl.algorithms.base import Algorithm, Tensors
from protofl.algorithms.contract import ClientRound, TrainedClient


def client_round(alg: Algorithm, broadcast: Tensors, x: torch.Tensor | None = None,
                 y: torch.Tensor | None = None, state: Tensors | None = None,
                 **settings: Any) -> ClientRound:
    """A :class:`ClientRound` for calling ``alg.client_begin`` by hand: round 1, client 0,
    ``alg.model``, SGD at lr 0.01, one step, unless ``settings`` say otherwise."""
    x = torch.zeros(0) if x is None else x
    y = torch.zeros(0, dtype=torch.long) if y is None else y
    fields = {"round": 1, "client": 0, "model": alg.model, "lr": 0.01, "steps": 1,
              "batch_size": max(len(y), 1), "optimizer": "sgd", "momentum": 0.0,
              "weight_decay": 0.0, "generator": torch.Generator().manual_seed(0), **settings}
    return ClientRound(broadcast=broadcast, state=state or {}, x=x, y=y, **fields)


def trained(c: ClientRound, params: Tensors, buffers: Tensors | None = None,
            ctx: Tensors | None = None, stats: Tensors | None = None) -> TrainedClient:
    """The :class:`TrainedClient` for ``alg.client_end`` after ``c``'s local training made
    ``params``/``buffers`` (``ctx``: what ``client_begin`` returned)."""
    base = {f.name: getattr(c, f.name) for f in dataclasses.fields(ClientRound)}
    return TrainedClient(**base, params=params, buffers=buffers or {}, ctx=ctx or {},
                         stats=stats or {})
