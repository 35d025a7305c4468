"""Every CPU core: a round's clients spread over worker processes, and the rule that picks a
trainer.

:class:`ParallelTrainer` starts ``workers`` processes at its first round and keeps them for the
run. Each worker gets the algorithm and the training rows once, without a copy: on Linux the
workers are forked, so they share the parent's pages (rows in memory, the memory-mapped dataset
cache) and nothing is pickled (a script needs no ``if __name__ == "__main__"`` guard); where
processes are spawned (macOS, Windows), rows memory-mapped from the cache are opened again from
their file and rows in memory are moved to shared memory and passed as a handle. Every round,
each worker trains its share of the jobs (balanced by their rows to process) with an ordinary
trainer (``inner``: the vectorized one where the model allows, else the sequential one) on one
torch thread (except a lead client: where the model's step is faster on several threads and
one client holds most of the round, :meth:`ParallelTrainer.lead` has that client trained
first here on every worker's core, the others spread after it); the broadcast and the
results travel as one shared-memory buffer per dtype (``pack``). A client's batches,
augmentation draws and persistent state are exactly those of the sequential path (they are
keyed by seed, round and client, never by process), so with the sequential inner trainer the
results are the sequential trainer's, bit for bit (a lead client's within the equivalence
tests' tolerance: its arithmetic is split over threads).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import traceback
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as tmp
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from protofl.algorithms.base import Algorithm
from protofl.data import store
from protofl.data.federated import FederatedData
from protofl.engine import costs, hetero, trainers
from protofl.engine.schedule import Job
from protofl.engine.train import (
    ClientResult,
    RoundContext,
    SequentialTrainer,
    Trainer,
    round_work,
)
from protofl.errors import ProtoflError
from protofl.models.nets import ProtoNet

log = logging.getLogger("protofl")

START = "fork" if sys.platform == "linux" else "spawn"  # how workers are started
PARENT_CHECK = 2.0  # seconds between a waiting worker's checks that its parent lives


def convolutional(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())


# ---- the training rows, shared ----

@dataclass(frozen=True)
class Mapped:
    """A tensor memory-mapped from a ``.npy`` file, opened again by path."""

    path: str
    shape: tuple[int, ...]
    dtype: str


def share(t: torch.Tensor) -> torch.Tensor | Mapped:
    """What a worker needs to see ``t`` without a copy: the file it is mapped from, or the
    tensor itself moved to shared memory (sent as a handle)."""
    path = store.mapped_file(t)
    if path is not None and path.endswith(".npy") and t.storage_offset() == 0 and (
            t.is_contiguous()):
        head = np.load(path, mmap_mode="r")
        if tuple(head.shape) == tuple(t.shape) and str(head.dtype) == str(t.numpy().dtype):
            return Mapped(path, tuple(t.shape), str(head.dtype))
    return t.share_memory_()


def opened(s: torch.Tensor | Mapped) -> torch.Tensor:
    """The tensor :func:`share` describes, in a worker."""
    if isinstance(s, Mapped):
        arr = np.load(s.path, mmap_mode="c")  # copy-on-write: the file stays as it is
        if tuple(arr.shape) != s.shape or str(arr.dtype) != s.dtype:
            raise ProtoflError(f"parallel trainer: {s.path} changed while the run was using it")
        return torch.from_numpy(arr)
    return s


@dataclass(frozen=True)
class SharedTraining:
    """The training split of a FederatedData as workers receive it (no rows pickled)."""

    name: str
    num_classes: int
    x_train: torch.Tensor | Mapped
    y_train: torch.Tensor | Mapped
    train_offsets: np.ndarray
    scale: float | None
    mean: tuple[float, ...] | None = None  # the rows' standardisation (FederatedData.inputs)
    std: tuple[float, ...] | None = None

    @classmethod
    def of(cls, data: FederatedData) -> SharedTraining:
        return cls(data.name, data.num_classes, share(data.x_train), share(data.y_train),
                   data.train_offsets, data.scale, data.mean, data.std)

    def open(self) -> FederatedData:
        """A FederatedData over the same training rows (empty test splits)."""
        x, y = opened(self.x_train), opened(self.y_train)
        none = np.zeros(len(self.train_offsets), dtype=np.int64)
        return FederatedData(self.name, self.num_classes, x, y, self.train_offsets, x[:0],
                             y[:0], none, x[:0], y[:0], scale=self.scale, mean=self.mean,
                             std=self.std)


# ---- the workers ----

def _worker(conn: Any, alg: Algorithm, data: FederatedData | SharedTraining, inner: str,
            dtype: torch.dtype, parent: int, rounds: int) -> None:
    """A worker's loop: ``(broadcast, jobs, client_states, setup, round)`` in, results out;
    it ends on ``None``, or when the parent process ``parent`` is gone (forked siblings hold
    copies of the pipes, so a dead parent is not always an end of file)."""
    torch.set_num_threads(1)
    torch.set_default_dtype(dtype)
    if isinstance(data, SharedTraining):
        data = data.open()
    torch._inductor.config.compile_threads = 1  # a daemonic process: no compile workers
    trainer: Trainer | None = None
    while True:
        try:
            while not conn.poll(PARENT_CHECK):
                if os.getppid() != parent:
                    return
            msg = conn.recv()
        except (EOFError, OSError):  # the parent went away
            return
        if msg is None:
            return
        shared, jobs, setup, rnd = msg
        broadcast, states = unpack(shared)
        try:
            if trainer is None:  # a heterogeneous federation: one model at a time
                trainer = hetero.grouped(_inner(inner, alg, setup.precision, rounds), alg)
            results = trainer.train(RoundContext(alg, broadcast, jobs, data, states, setup,
                                                 rnd))
            conn.send(("ok", pack([(r.client, r.upload, r.state, r.loss) for r in results])))
        except BaseException:  # noqa: BLE001 - reported to the parent, which raises
            conn.send(("error", traceback.format_exc()))


def _inner(name: str, alg: Algorithm, precision: str, rounds: int) -> Trainer:
    """A worker's trainer: ``auto`` (the in-process trainers' per-round choice) or a name."""
    if name == "auto":
        return trainers.Auto(alg.model, "cpu", 1, precision, rounds, in_process=True)
    return trainers.make(name, alg.model, "cpu", 1, precision)


def _stop(procs: list, conns: list) -> None:
    for c in conns:
        try:
            c.send(None)
            c.close()
        except (OSError, ValueError):
            pass
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)


def split_jobs(jobs: list[Job], data: FederatedData, batch_size: int, by_steps: bool,
               parts: int) -> list[list[Job]]:
    """Jobs in ``parts`` groups of about equal local steps, longest first to the least loaded
    group (``costs.split``)."""
    steps = [costs.job_steps(j, data, batch_size, by_steps) for j in jobs]
    return [[jobs[i] for i in part] for part in costs.split(steps, parts)]


class ParallelTrainer:
    """A round's jobs spread over ``workers`` processes, each training its share with the
    ``inner`` trainer on one thread (``auto``: the in-process trainers' per-round choice, or a
    trainer's name). The processes start at the first round and stop with :meth:`close` (or
    when the trainer is collected)."""

    name = "parallel"
    description = ("the round's clients spread over worker processes (CPU), longest first "
                   "to the least loaded, each worker choosing its own in-process trainer (a "
                   "long client of a model that pays for threads first, on every core)")
    groups_inside = True  # each worker splits a heterogeneous round by model (engine/hetero.py)

    def __init__(self, workers: int, inner: str = "auto", start: str = START,
                 rounds: int = 1):
        if workers < 1:
            raise ProtoflError(f"parallel trainer: workers = {workers}; at least 1")
        self.workers, self.inner, self.start, self.rounds = workers, inner, start, rounds
        names = trainers.IN_PROCESS if inner == "auto" else (inner,)
        self.estimators = [trainers.trainer_class(n)() for n in names]
        self._procs: list = []
        self._conns: list = []
        self._for: tuple[int, int] | None = None  # id of the algorithm and data served
        self._finalizer: weakref.finalize | None = None

    @staticmethod
    def unable(model: ProtoNet, precision: str, device: torch.device) -> str | None:
        return trainers.parallel_reason(model, torch.device(device), 2)

    def spread_seconds(self, work: costs.Work) -> float:
        """The longest worker's share at its cheapest in-process trainer, plus the round's
        messages."""
        shares = [tuple(work.steps[i] for i in part)
                  for part in costs.split(list(work.steps), self.workers) if part]
        longest = max((min(e.estimate(dataclasses.replace(work, steps=share))
                           for e in self.estimators) for share in shares), default=0.0)
        return longest + work.message() * len(work.steps)

    def lead(self, work: costs.Work) -> tuple[int | None, float]:
        """The job trained alone on every worker's core before the others are spread (the
        longest, where the model's step is faster on that many threads and the round
        cheaper than spreading them all, each by more than ``trainers.CLOSE``; else None),
        and the round's estimate."""
        spread = self.spread_seconds(work)
        if not work.steps or (costs.wide_step(work, self.workers)
                              >= costs.plain_step(work) * (1 - trainers.CLOSE)):
            return None, spread
        i = work.steps.index(max(work.steps))
        rest = dataclasses.replace(work, steps=work.steps[:i] + work.steps[i + 1:])
        led = (work.steps[i] * costs.wide_step(work, self.workers)
               + (self.spread_seconds(rest) if rest.steps else 0.0))
        return (i, led) if led < spread * (1 - trainers.CLOSE) else (None, spread)

    def estimate(self, work: costs.Work) -> float:
        """:meth:`lead`'s estimate, plus the workers' start spread over the rounds left."""
        start = 0.0 if self._procs else self.workers * work.constants()["fork"]
        return self.lead(work)[1] + start / work.rounds_left

    def _start(self, rc: RoundContext) -> None:
        self.close()
        ctx = tmp.get_context(self.start)
        shared = rc.data if self.start == "fork" else SharedTraining.of(rc.data)
        for _ in range(self.workers):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, daemon=True, args=(
                child, rc.alg, shared, self.inner, torch.get_default_dtype(), os.getpid(),
                self.rounds))
            try:
                p.start()
            except Exception as e:  # noqa: BLE001 - e.g. an algorithm that cannot be pickled
                _stop(self._procs, self._conns)
                self._procs, self._conns = [], []
                raise ProtoflError(f"parallel trainer: cannot start a worker process ({e}); "
                                   "use trainer: vectorized or sequential") from None
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        self._for = (id(rc.alg), id(rc.data))
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns)

    def close(self) -> None:
        """Stop the worker processes (a later round starts them again)."""
        if self._finalizer is not None:
            self._finalizer()
        self._procs, self._conns, self._for, self._finalizer = [], [], None, None

    def train(self, rc: RoundContext) -> list[ClientResult]:
        if not rc.jobs:
            return []
        first, _ = self.lead(round_work(rc, max(1, self.rounds - rc.round + 1)))
        if first is None:
            return self.spread(rc)
        rest = self.spread(dataclasses.replace(rc, jobs=[j for k, j in enumerate(rc.jobs)
                                                         if k != first]))
        led = self.wide(dataclasses.replace(rc, jobs=[rc.jobs[first]]))
        by_client = {r.client: r for r in rest + led}
        return [by_client[j.client] for j in rc.jobs if j.client in by_client]

    def wide(self, rc: RoundContext) -> list[ClientResult]:
        """``rc``'s jobs trained here, one after another, on ``workers`` torch threads (the
        workers wait meanwhile: their cores are free)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(self.workers)
        try:
            return hetero.grouped(SequentialTrainer(), rc.alg).train(rc)
        finally:
            torch.set_num_threads(threads)

    def spread(self, rc: RoundContext) -> list[ClientResult]:
        """``rc``'s jobs spread over the workers, each on one thread."""
        if not rc.jobs:
            return []
        if self._for != (id(rc.alg), id(rc.data)):
            self._start(rc)
        groups = split_jobs(rc.jobs, rc.data, rc.setup.batch_size, rc.setup.by_steps,
                            self.workers)
        busy = []
        for conn, group in zip(self._conns, groups):
            if group:
                states = {j.client: rc.client_states[j.client] for j in group
                          if j.client in rc.client_states}
                conn.send((pack((rc.broadcast, states)), group, rc.setup, rc.round))
                busy.append(conn)
        by_client: dict[int, ClientResult] = {}
        failure = None
        for conn in busy:
            try:
                status, payload = conn.recv()
            except EOFError:
                status, payload = "error", "a worker process died"
            if status == "ok":
                for client, upload, state, loss in unpack(payload):
                    if rc.upload_hook is not None:  # deterministic per (round, client): here
                        upload = rc.upload_hook(rc, client, upload)
                    by_client[client] = ClientResult(client, upload, _own(state), loss)
            else:
                failure = failure or payload
        if failure is not None:
            self.close()
            raise RuntimeError(f"parallel trainer: a worker failed:\n{failure}")
        return [by_client[j.client] for j in rc.jobs if j.client in by_client]


@dataclass(frozen=True)
class Slot:
    """Where a packed tensor is: its buffer (dtype), offset and shape."""

    dtype: torch.dtype
    offset: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Packed:
    """A nested structure (dicts, lists, tuples) whose tensors travel in one shared-memory
    buffer per dtype (one segment and one handle each, instead of one per tensor: a round of 30
    small clients has hundreds of tensors); in ``skeleton`` each tensor is a :class:`Slot`."""

    buffers: dict[torch.dtype, torch.Tensor]
    skeleton: Any


def pack(tree: Any) -> Packed:
    """``tree`` with its CPU tensors copied into shared buffers (see :class:`Packed`)."""
    tensors = [v for v in tree_leaves(tree) if isinstance(v, torch.Tensor)]
    sizes: dict[torch.dtype, int] = {}
    for t in tensors:
        sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel()
    buffers = {d: torch.empty(n, dtype=d).share_memory_() for d, n in sizes.items()}
    used = dict.fromkeys(sizes, 0)

    def place(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        off, n = used[v.dtype], v.numel()
        buffers[v.dtype][off:off + n].copy_(v.detach().reshape(-1))
        used[v.dtype] = off + n
        return Slot(v.dtype, off, tuple(v.shape))

    return Packed(buffers, tree_map(place, tree))


def unpack(p: Packed) -> Any:
    """The structure :func:`pack` packed; its tensors are views of the shared buffers."""
    def view(v: Any) -> Any:
        if not isinstance(v, Slot):
            return v
        return p.buffers[v.dtype][v.offset:v.offset + math.prod(v.shape)].view(v.shape)

    return tree_map(view, p.skeleton)


def _own(tree: Any) -> Any:
    """Tensors received from a worker copied out of shared memory (client states are kept for
    many rounds; shared segments are released as soon as the copies exist)."""
    return tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, tree)
