"""Trainers: who runs a round's local training. One protocol, several back ends.

A trainer takes one :class:`RoundContext` (the algorithm, the broadcast, the round's jobs, the
data, the clients' persistent states, the local-training setup) and returns one
:class:`ClientResult` per job it could train. :class:`SequentialTrainer` here is the reference
path; the vectorized trainer (``engine/vectorized.py``) must give the same results, and the
Flower server sends the jobs to SuperNodes. Every trainer prepares and finishes clients with
``prepare_client``/``finish_client`` and the batch schedule, and differs only in the loop.

Per-batch statistics: every step calls ``alg.loss_and_stats``; the statistics of the batches of
the client's last pass (``ClientWork.stats_from`` on; see ``schedule.local_schedule``) are summed
in float64 and handed to ``client_end`` as ``TrainedClient.stats``.

Devices: the model, the broadcast and the active clients' states are on ``LocalSetup.device``
(``placed``); a client's rows move there when it is prepared, and its batch order and
augmentation draws still come from CPU generators, so every device trains on the same batches.
``LocalSetup.precision`` runs the loss under autocast (fp16 with a loss scaler).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.utils._pytree import tree_map

from protofl import device as devices
from protofl.algorithms.base import Algorithm, Tensors
from protofl.algorithms.contract import ClientRound, TrainedClient
from protofl.algorithms.optimizers import make_optimizer
from protofl.data.federated import FederatedData
from protofl.data.pipeline import Transform, compose
from protofl.engine import costs
from protofl.engine.schedule import Job, local_schedule
from protofl.seeding import AUGMENT, HOOK, ORDER, torch_gen


@dataclass(frozen=True)
class LocalSetup:
    """The local-training settings of a run."""

    batch_size: int
    by_steps: bool  # Job.units counts batches (local_steps) instead of epochs
    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0
    device: str = "cpu"  # where clients train (a torch device string)
    precision: str = "fp32"  # fp32, or autocast in bf16 / fp16
    augment: Transform | None = None  # the data's batch transform, before the algorithm's
    lr_decay: float = 1.0  # round t trains at lr * lr_decay^(t-1)

    def at(self, round: int) -> LocalSetup:
        """The setup of round ``round`` (from 1): its learning rate decayed."""
        if self.lr_decay == 1:
            return self
        return dataclasses.replace(self, lr=self.lr * self.lr_decay ** (round - 1))


@dataclass(frozen=True)
class RoundContext:
    """Everything a trainer needs for one round."""

    alg: Algorithm  # its ``model`` is the model trained
    broadcast: Tensors  # what the server sent the round's clients
    jobs: list[Job]
    data: FederatedData
    client_states: dict[int, Tensors]  # persistent per-client state, by client
    setup: LocalSetup
    round: int
    # what a client makes of its upload before sending it (its DP / secure-sum contribution)
    upload_hook: Callable[[RoundContext, int, Tensors], Tensors] | None = None

    def client_state(self, client: int) -> Tensors:
        return self.client_states.get(client, {})


def round_work(rc: RoundContext, rounds_left: int = 1) -> costs.Work:
    """The work of a round's jobs (before any client is prepared). A learning rate that
    decays every round is compiled into every round's graphs anew: a compile is then spread
    over one round."""
    s = rc.setup
    steps = [costs.job_steps(j, rc.data, s.batch_size, s.by_steps) for j in rc.jobs]
    return costs.Work.of(rc.alg.model, rc.data.inputs(rc.data.x_train[:1]), s.batch_size,
                         s.device, steps, rounds_left if s.lr_decay == 1 else 1)


def placed(rc: RoundContext) -> RoundContext:
    """``rc`` with the broadcast and its jobs' client states on the setup's device (tensors
    already there are not copied)."""
    dev = rc.setup.device
    states = {j.client: devices.to_device(rc.client_states[j.client], dev)
              for j in rc.jobs if j.client in rc.client_states}
    return dataclasses.replace(rc, broadcast=devices.to_device(rc.broadcast, dev),
                               client_states=states)


@dataclass
class ClientResult:
    client: int
    upload: Tensors
    state: Tensors
    loss: float  # mean training loss over its local batches


class Trainer(Protocol):
    """Trains a round's jobs; results in job order, for the jobs it could train. A trainer in
    the registry (``engine/trainers.py``) also has a ``description``, a static
    ``unable(model, precision, device)`` and ``estimate(work)``."""

    name: str

    def train(self, rc: RoundContext) -> list[ClientResult]: ...


@dataclass
class ClientWork:
    """Everything about one client's round except the training loop itself."""

    job: Job
    round: ClientRound  # what its hooks see (x, y: its training inputs and labels)
    ctx: Tensors  # what client_begin returned
    batches: list[torch.Tensor]
    augment_gen: torch.Generator
    class_counts: torch.Tensor  # (C,) its samples per class, for a pipeline transform
    stats_from: int = 0  # first batch whose statistics count (the last pass)
    transform: Transform | None = None  # the data's augmentation, then the algorithm's

    @property
    def x(self) -> torch.Tensor:
        """The client's training inputs (as the model sees them)."""
        return self.round.x

    @property
    def y(self) -> torch.Tensor:
        return self.round.y


def prepare_client(rc: RoundContext, job: Job) -> ClientWork:
    """The client's data (on the setup's device), its loss context and its batch schedule for
    this round (``rc`` as ``placed`` gives it)."""
    alg, setup = rc.alg, rc.setup
    x, y_host = rc.data.client_train(job.client)
    x, y = rc.data.inputs(devices.upload(x, setup.device)), y_host.to(setup.device)
    order = torch_gen(setup.seed, ORDER, rc.round, job.client)
    batches, last = local_schedule(alg.pipeline.order, y_host, job.units, setup.batch_size,
                                   setup.by_steps, order)
    c = ClientRound(round=rc.round, client=job.client, model=alg.model, broadcast=rc.broadcast,
                    state=rc.client_state(job.client), x=x, y=y, lr=setup.lr,
                    steps=len(batches), batch_size=setup.batch_size, optimizer=setup.optimizer,
                    momentum=setup.momentum, weight_decay=setup.weight_decay,
                    generator=torch_gen(setup.seed, HOOK, rc.round, job.client))
    ctx = alg.client_begin(c)
    transform = compose(setup.augment, alg.pipeline.transform)
    counts = (torch.bincount(y.flatten(), minlength=rc.data.num_classes)[:rc.data.num_classes]
              if transform is not None else torch.empty(0))
    return ClientWork(job, c, ctx, batches, torch_gen(setup.seed, AUGMENT, rc.round, job.client),
                      counts, len(batches) - last, transform)


def add_stats(total: Tensors | None, stats: Tensors) -> Tensors | None:
    """``total + stats`` leaf by leaf, in float64 where the device has it (None and empty
    statistics add nothing)."""
    if not stats:
        return total
    stats = tree_map(lambda v: v.detach().to(devices.wide(v.device)), stats)
    return stats if total is None else tree_map(torch.add, total, stats)


def transformed(alg: Algorithm, work: ClientWork, x: torch.Tensor, y: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch through the client's transforms (the data's augmentation, then the
    algorithm's pipeline transform), if it has any."""
    if work.transform is None:
        return x, y
    return work.transform(x, y, work.augment_gen, work.class_counts)


def finish_client(rc: RoundContext, work: ClientWork, params: Tensors, buffers: Tensors,
                  loss: float, stats: Tensors | None = None) -> ClientResult:
    """The client's upload and new state from its trained weights and last-pass
    statistics."""
    rc.alg.model.eval()
    upload, state = rc.alg.client_end(TrainedClient(
        **vars(work.round), params={k: v.detach() for k, v in params.items()},
        buffers={k: v.detach() for k, v in buffers.items()}, ctx=work.ctx, stats=stats or {}))
    if rc.upload_hook is not None:
        upload = rc.upload_hook(rc, work.job.client, upload)
    return ClientResult(work.job.client, upload, state, loss)


def train_client(rc: RoundContext, job: Job) -> ClientResult:
    """One client's round with an ordinary optimizer loop over the algorithm's functional loss
    (the reference path; the Flower ClientApp calls this too)."""
    rc = placed(dataclasses.replace(rc, jobs=[job]))
    alg, setup = rc.alg, rc.setup
    model = alg.model
    model.eval()
    work = prepare_client(rc, job)
    start = alg.local_start(rc.broadcast, rc.client_state(job.client))
    params = {k: v.clone().requires_grad_(True) for k, v in start["params"].items()}
    buffers = {k: v.clone() for k, v in start["buffers"].items()}
    opt = make_optimizer(list(params.values()), setup.optimizer, setup.lr, setup.momentum,
                         setup.weight_decay)
    scaler = devices.grad_scaler(setup.device, setup.precision)
    model.train()
    total, stats = 0.0, None
    for t, idx in enumerate(work.batches):
        xb, yb = transformed(alg, work, work.x[idx], work.y[idx])
        ones = torch.ones(len(yb), dtype=xb.dtype, device=xb.device)
        with devices.autocast(setup.device, setup.precision):
            loss, batch_stats = alg.loss_and_stats(model, params, buffers, xb, yb, ones,
                                                   work.ctx)
        if t >= work.stats_from:
            stats = add_stats(stats, batch_stats)
        opt.zero_grad(set_to_none=True)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        total += loss.item()
    return finish_client(rc, work, params, buffers, total / max(len(work.batches), 1), stats)


class SequentialTrainer:
    """The round's jobs one after another (the reference path)."""

    name = "sequential"
    description = "the round's clients one after another, an ordinary optimizer loop each"

    @staticmethod
    def unable(model: torch.nn.Module, precision: str, device: torch.device) -> str | None:
        return None

    def estimate(self, work: costs.Work) -> float:
        return costs.sequential_seconds(work)

    def train(self, rc: RoundContext) -> list[ClientResult]:
        rc = placed(rc)  # the broadcast moved once, not once per client
        return [train_client(rc, job) for job in rc.jobs]
