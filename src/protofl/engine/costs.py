"""What a round's local training costs on each trainer: the cost model the trainers' choice
reads (``engine/trainers.py``; each trainer's ``estimate`` is built from these functions).

A step's time is an overhead (Python, dispatch, autograd bookkeeping) plus its arithmetic:
``3 x`` the model's forward FLOPs per sample x the batch (forward and backward) at a sustained
rate. The plain step (one client, ordinary autograd) pays its overhead per client; a vmap step
pays a larger overhead once for its ``n`` clients and a small one per client; a compiled step
(``engine/compiled.py``) pays the least, after a one-off compile per stack size. The constants
were measured with ``benchmarks/trainer_costs.py`` on this project's 2-core build machine
(torch 2.13 CPU, one thread): a fit over the Synthetic MLP (60-128-256-10) and the LEAF CNN at
batches of 10, 1-16 clients; the two ``thread_`` constants from their plain steps on 2
threads (the LEAF CNN's 1.6x faster, the MLP's a little slower: its ops are too small to
share). A one-off cost (a compile, starting worker processes) is spread over the rounds left,
so a long run pays it and a short one does not.

A work's ``table`` replaces these constants by a calibration's (``engine/calibrate.py``: the
steps of this model at this batch timed on this machine, the arithmetic folded into the
overheads, ``rate`` infinite). Only ``trainer: auto``'s choice of a round's trainer reads it;
the choices inside a trainer that shape its numbers (the vectorized trainer's plain tail, the
parallel trainer's lead) read the constants, so a round's numbers depend on its trainer alone
and a recorded plan replays them.
"""

from __future__ import annotations

import heapq
import math
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from protofl.data.federated import FederatedData
    from protofl.engine.schedule import Job

# seconds; FLOP rate in FLOP/s (one CPU thread)
CPU = {
    "plain": 5e-4,  # overhead of one client's plain step
    "vmap": 1.5e-3,  # overhead of a vmap step, once
    "vmap_client": 1e-4,  # ... and per client in it
    "compiled": 4e-4,  # overhead of one call of a compiled graph (a window of steps)
    "compiled_client": 5e-5,  # ... and per client and step in it
    "rate": 4e10,
    "compile": 10.0,  # one compile (one stack size: a looped window, engine/compiled.py)
    "fork": 0.3,  # starting one worker process (once a run)
    "message": 6e-4,  # a round's messages to and from workers, per client ...
    "message_byte": 7.5e-10,  # ... and per byte of the model's weights
    "thread_gain": 0.65,  # each torch thread past the first adds this much arithmetic rate
    "thread_sync": 2.5e-5,  # ... and costs this much a step (its share of the sync)
}
# on a GPU the arithmetic of these models is nearly free and every launch costs: vmap pays
# (estimates until measured on a GPU: benchmarks/gpu.sh)
CUDA = {"plain": 6e-4, "vmap": 1.2e-3, "vmap_client": 2e-6, "compiled": 2e-4,
        "compiled_client": 1e-6, "rate": 5e12, "compile": 60.0, "fork": 0.3, "message": 6e-4,
        "message_byte": 7.5e-10, "thread_gain": 0.0, "thread_sync": 0.0}
# the most steps in one compiled graph (engine/compiled.py: a window), the steps one after
# another (each traced and compiled), or as a loop in the graph (traced and compiled once)
COMPILED_STEPS = 8
LOOPED_STEPS = 32


@dataclass(frozen=True)
class Work:
    """A set of clients' local training: each client's steps, the batch, the model's forward
    FLOPs per sample, the device, the run's rounds left (this one included) and the bytes of
    the model's weights."""

    steps: tuple[int, ...]
    batch: int
    flops: float
    device: str = "cpu"
    rounds_left: int = 1
    table: dict[str, float] | None = field(default=None, compare=False, hash=False)
    weights: int = 0

    @classmethod
    def of(cls, model: torch.nn.Module, x1: torch.Tensor, batch: int, device: str | torch.device,
           steps: list[int], rounds_left: int = 1) -> Work:
        """The work of ``steps`` of ``model`` at ``batch`` rows like ``x1`` on ``device``."""
        return cls(tuple(steps), batch, forward_flops(model, tuple(x1.shape[1:]), x1.dtype),
                   torch.device(device).type, rounds_left,
                   weights=sum(p.numel() * p.element_size() for p in model.parameters()))

    def message(self) -> float:
        """Seconds of one client's messages to and from a worker process."""
        c = self.constants()
        return c["message"] + self.weights * c["message_byte"]

    def constants(self) -> dict[str, float]:
        if self.table is not None:
            return self.table
        return CUDA if self.device == "cuda" else CPU

    def arithmetic(self) -> float:
        """Seconds of one client's step of arithmetic (forward and backward)."""
        return 3 * self.flops * self.batch / self.constants()["rate"]

    def active(self) -> list[tuple[int, int]]:
        """``(steps, n)``: how many steps ``n`` clients still take together (clients sorted
        by steps, most first, so those with a step ``t`` are a prefix)."""
        s = sorted(self.steps, reverse=True) + [0]
        return [(s[i] - s[i + 1], i + 1) for i in range(len(self.steps)) if s[i] > s[i + 1]]


def job_steps(job: Job, data: FederatedData, batch_size: int, by_steps: bool) -> int:
    """A job's local steps: its units, or its epochs of ``ceil(n_k / B)`` batches."""
    if by_steps:
        return job.units
    return job.units * math.ceil(int(data.train_sizes[job.client]) / batch_size)


def split(loads: list[int], parts: int) -> list[list[int]]:
    """Indices of ``loads`` in ``parts`` groups of about equal sum: largest first to the least
    loaded group (ties: the lower group, the earlier index)."""
    groups: list[list[int]] = [[] for _ in range(parts)]
    heap = [(0, g) for g in range(parts)]
    for i in sorted(range(len(loads)), key=lambda i: -loads[i]):
        load, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (load + loads[i], g))
    return groups


_FLOPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def forward_flops(model: torch.nn.Module, shape: tuple[int, ...],
                  dtype: torch.dtype = torch.float32) -> float:
    """FLOPs of one sample's forward pass (counted on the meta device: no arithmetic; once
    per model and input shape)."""
    from torch.utils.flop_counter import FlopCounterMode

    seen = _FLOPS.setdefault(model, {})
    if (shape, dtype) not in seen:
        counter = FlopCounterMode(display=False)
        params = {k: torch.empty_like(v, device="meta") for k, v in model.state_dict().items()}
        with torch.no_grad(), counter:
            torch.func.functional_call(model, params,
                                       (torch.empty((1, *shape), dtype=dtype, device="meta"),))
        seen[(shape, dtype)] = float(max(counter.get_total_flops(), 1))
    return seen[(shape, dtype)]


def plain_step(work: Work) -> float:
    return work.constants()["plain"] + work.arithmetic()


def wide_step(work: Work, threads: int) -> float:
    """One client's plain step on ``threads`` torch threads: its arithmetic shared (each
    thread past the first adds ``thread_gain`` of one), plus each extra thread's sync."""
    c = work.constants()
    extra = threads - 1
    return (c["plain"] + extra * c["thread_sync"]
            + work.arithmetic() / (1 + extra * c["thread_gain"]))


def vmap_step(work: Work, n: int) -> float:
    c = work.constants()
    return c["vmap"] + n * (c["vmap_client"] + work.arithmetic())


def window(longest: int, most: int = COMPILED_STEPS) -> int:
    """Steps in one compiled graph for rounds whose longest client takes ``longest`` steps:
    at most ``most``, the windows as even as they can be, so that the last is padded the
    least (20 steps at most 8: three windows of 7, one step padded, not three of 8 with
    four)."""
    windows = max(1, -(-longest // most))
    return max(1, -(-longest // windows))


def compiled_step(work: Work, m: int, steps: int = COMPILED_STEPS) -> float:
    """One step of ``m`` clients in a compiled graph of ``steps`` steps (its call's overhead
    shared by them)."""
    c = work.constants()
    return c["compiled"] / steps + m * (c["compiled_client"] + work.arithmetic())


def solo_max(work: Work) -> int:
    """The most clients for which plain steps one by one cost no more than one vmap step."""
    n = 0
    while n < len(work.steps) and (n + 1) * plain_step(work) <= vmap_step(work, n + 1):
        n += 1
    return n


def vectorized_seconds(work: Work) -> float:
    """The vectorized trainer's estimate: each step the cheaper of a vmap step and plain
    steps (``solo_max``)."""
    solo = solo_max(work)
    return sum(steps * (n * plain_step(work) if n <= solo else vmap_step(work, n))
               for steps, n in work.active())


def sequential_seconds(work: Work) -> float:
    return sum(work.steps) * plain_step(work)


def bucket(n: int, most: int) -> int:
    """The compiled stack size a step of ``n`` clients runs at: the next power of two (at
    most ``most``), so a round compiles at most ``log2(most) + 1`` sizes."""
    return min(1 << max(n - 1, 0).bit_length(), most)


def compiled_seconds(work: Work, compiled: frozenset[int] = frozenset(),
                     steps: int | None = None) -> float:
    """The compiled trainer's estimate: its steps in windows of ``steps`` (default
    ``window`` of the longest client's; the last window padded), and the compile of each
    stack size it needs that is not in ``compiled`` yet, spread over the rounds left."""
    most = len(work.steps)
    active = work.active()
    w = steps or window(max(work.steps, default=0))
    sizes = {bucket(n, most) for _, n in active} - compiled
    run = sum(k * compiled_step(work, bucket(n, most), w) for k, n in active)
    pad = -max(work.steps, default=0) % w  # steps no client has, at the tail's width
    run += pad * compiled_step(work, bucket(active[0][1], most), w) if active else 0.0
    return run + len(sizes) * work.constants()["compile"] / work.rounds_left

