"""The algorithm contract: what each client hook of an algorithm is given.

An algorithm (``protofl.algorithms.base.Algorithm``) is a client part and a server part.
Every trainer (sequential, vectorized, compiled, parallel, Flower) calls its hooks the same
way, once per client and round::

    ctx = alg.client_begin(c)                        # c: ClientRound -> the loss's constants
    loss, stats = alg.loss_and_stats(model, params, buffers, x, y, w, ctx)  # each step (vmap-able)
    upload, state = alg.client_end(t)                # t: TrainedClient -> upload, client state
    state, diagnostics = alg.aggregate(state, uploads, round)   # the server, once a round

``client_begin`` and ``client_end`` each get one frozen context object; ``loss`` stays a
plain function of tensors (the trainers stack many clients' steps with ``torch.func.vmap``);
``aggregate`` sees the server state, the round's valid uploads and the round number, and the
federation (client count, sizes) as ``self.federation``.

The contract carries a version, :data:`CONTRACT`: an algorithm class says which version it
was written for in its class attribute ``contract``, and protofl refuses one written for
another version with one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from protofl.models.nets import ProtoNet

Tensors = dict[str, Any]  # nested dict of tensors

CONTRACT = 2  # version 1: client_begin/client_end took positional arguments (protofl 0.1)


@dataclass(frozen=True)
class ClientRound:
    """What ``client_begin`` is given: one client's round before its local training."""

    round: int  # the round, from 1
    client: int  # the client's index in the federation
    model: ProtoNet  # the model the algorithm trains (``alg.model``), for functional calls
    broadcast: Tensors  # what the server sent this round (``alg.broadcast(state)``)
    state: Tensors  # the client's persistent state ({} before its first round)
    x: torch.Tensor  # its training inputs, on the training device
    y: torch.Tensor  # its labels
    lr: float  # this round's local learning rate (``clients.lr_decay`` applied)
    steps: int  # the optimizer steps it takes this round (a straggler's fewer)
    batch_size: int
    optimizer: str  # "sgd" or "adam"
    momentum: float
    weight_decay: float
    generator: torch.Generator  # seeded by (run seed, round, client): the hooks' own draws

    @property
    def num_samples(self) -> int:
        """n_k, the client's training samples."""
        return len(self.y)


@dataclass(frozen=True)
class TrainedClient(ClientRound):
    """What ``client_end`` is given: the :class:`ClientRound` and what local training made."""

    params: Tensors  # the trained parameters (detached)
    buffers: Tensors  # the trained buffers
    ctx: Tensors  # what ``client_begin`` returned
    stats: Tensors  # ``loss_and_stats``' statistics summed over the last pass ({}: none)
