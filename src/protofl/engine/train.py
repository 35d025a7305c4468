"""Local training of a round's active clients, one after another (the reference path).

The vectorized trainer (``engine/vectorized.py``) must give the same result; both share
``prepare_client``/``finish_client`` and the batch schedule, and differ only in the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protofl.algorithms.base import Algorithm, Tensors
from protofl.data.federated import FederatedData
from protofl.engine.schedule import AUGMENT, ORDER, Job, local_batches, torch_gen
from protofl.models.nets import ProtoNet


@dataclass(frozen=True)
class LocalSetup:
    """The local-training settings of a run."""

    batch_size: int
    by_steps: bool  # Job.amount counts batches (local_steps) instead of epochs
    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0


@dataclass
class ClientResult:
    client: int
    upload: Tensors
    state: Tensors
    loss: float  # mean training loss over its local batches


@dataclass
class ClientWork:
    """Everything about one client's round except the training loop itself."""

    job: Job
    x: torch.Tensor
    y: torch.Tensor
    ctx: Tensors
    batches: list[torch.Tensor]
    augment_gen: torch.Generator


def make_optimizer(params: list[torch.Tensor], s: LocalSetup) -> torch.optim.Optimizer:
    if s.optimizer == "adam":
        return torch.optim.Adam(params, lr=s.lr, weight_decay=s.weight_decay)
    return torch.optim.SGD(params, lr=s.lr, momentum=s.momentum, weight_decay=s.weight_decay)


def prepare_client(alg: Algorithm, model: ProtoNet, glob: Tensors, job: Job,
                   data: FederatedData, client_state: Tensors, s: LocalSetup, rnd: int
                   ) -> ClientWork:
    x, y = data.client_train(job.client)
    ctx = alg.client_begin(model, glob, client_state, x, y)
    order = torch_gen(s.seed, ORDER, rnd, job.client)
    batches = local_batches(alg.epoch_order, y, job.amount, s.batch_size, s.by_steps, order)
    return ClientWork(job, x, y, ctx, batches, torch_gen(s.seed, AUGMENT, rnd, job.client))


def finish_client(alg: Algorithm, model: ProtoNet, glob: Tensors, work: ClientWork,
                  params: Tensors, buffers: Tensors, client_state: Tensors, loss: float
                  ) -> ClientResult:
    params = {k: v.detach() for k, v in params.items()}
    buffers = {k: v.detach() for k, v in buffers.items()}
    model.eval()
    upload, state = alg.client_end(model, params, buffers, glob, work.ctx, client_state,
                                   work.x, work.y)
    return ClientResult(work.job.client, upload, state, loss)


def train_client(alg: Algorithm, model: ProtoNet, glob: Tensors, job: Job, data: FederatedData,
                 client_state: Tensors, s: LocalSetup, rnd: int) -> ClientResult:
    """One client's round with an ordinary optimizer loop over the algorithm's functional loss
    (the reference path; the Flower ClientApp calls this too)."""
    model.eval()
    work = prepare_client(alg, model, glob, job, data, client_state, s, rnd)
    start = alg.local_start(glob, client_state)
    params = {k: v.clone().requires_grad_(True) for k, v in start["params"].items()}
    buffers = {k: v.clone() for k, v in start["buffers"].items()}
    opt = make_optimizer(list(params.values()), s)
    model.train()
    total = 0.0
    for idx in work.batches:
        xb, yb = work.x[idx], work.y[idx]
        xb = alg.augment(xb, yb, work.augment_gen, work.ctx)
        loss = alg.loss(model, params, buffers, xb, yb, torch.ones(len(yb), dtype=xb.dtype),
                        work.ctx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += loss.item()
    return finish_client(alg, model, glob, work, params, buffers, client_state,
                         total / max(len(work.batches), 1))


def train_sequential(alg: Algorithm, model: ProtoNet, glob: Tensors, jobs: list[Job],
                     data: FederatedData, client_states: dict[int, Tensors], s: LocalSetup,
                     rnd: int) -> list[ClientResult]:
    """Train the round's jobs one after another."""
    return [train_client(alg, model, glob, job, data, client_states.get(job.client, {}), s, rnd)
            for job in jobs]
