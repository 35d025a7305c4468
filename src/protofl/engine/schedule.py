"""Who trains in a round and on which batches: client sampling, stragglers, batch order.

Every random choice is drawn from a generator keyed by (seed, purpose, round[, client])
(``protofl.seeding``), so a round's choices do not depend on the order clients are trained
in, on the trainer, or on whether the run was resumed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from protofl.data.pipeline import Order


def sample_clients(sizes: np.ndarray, k: int, scheme: str, rng: np.random.Generator
                   ) -> np.ndarray:
    """``k`` distinct clients, with probability proportional to size (``weighted``) or
    uniformly (``uniform``); returned sorted."""
    p = sizes / sizes.sum() if scheme == "weighted" else None
    return np.sort(rng.choice(len(sizes), size=k, replace=False, p=p))


def drop_out(active: np.ndarray, share: float, rng: np.random.Generator) -> np.ndarray:
    """The sampled clients that stay in the round: ``round(share * len(active))`` of them,
    drawn uniformly, drop out (none when ``share`` is 0, and no draw is made)."""
    n = int(round(share * len(active)))
    if not n:
        return active
    return np.setdiff1d(active, rng.choice(active, size=n, replace=False))


@dataclass(frozen=True)
class Job:
    """One active client's work in a round: ``units`` local epochs, or local steps when the
    run counts steps (``clients.local_steps``)."""

    client: int
    units: int
    straggler: bool = False


def assign_work(active: np.ndarray, full: int, stragglers: float, tolerate: bool,
                rng: np.random.Generator) -> list[Job]:
    """A fraction ``stragglers`` of the active clients do partial work: ``U{1..full-1}``
    epochs (or steps) when tolerated, or they are dropped when not."""
    n_slow = int(round(stragglers * len(active)))
    slow = set(rng.choice(active, size=n_slow, replace=False).tolist()) if n_slow else set()
    jobs = []
    for k in active.tolist():
        if k not in slow:
            jobs.append(Job(k, full))
        elif tolerate and full > 1:
            jobs.append(Job(k, int(rng.integers(1, full)), straggler=True))
        elif tolerate:
            jobs.append(Job(k, full, straggler=True))
    return jobs


def local_schedule(order: Order, y: torch.Tensor, units: int, batch_size: int, by_steps: bool,
                   gen: torch.Generator) -> tuple[list[torch.Tensor], int]:
    """Index batches for one client and how many of the last ones form its *last pass*.

    Batches: ``units`` epochs of ``order``'s sample order cut into batches of ``batch_size``
    (last one partial), or exactly ``units`` batches cycling epochs (``by_steps``). The last
    pass is the last epoch's batches; with ``by_steps`` it is the last ``ceil(L / batch_size)``
    batches (at most all of them), L the length of one epoch of ``order``: one epoch's worth
    of the most recent steps (the window per-batch statistics are summed over, e.g. fedproin's
    influence counts)."""
    batches: list[torch.Tensor] = []
    if not by_steps:
        last = 0
        for _ in range(units):
            epoch = order(y, gen).split(batch_size)
            batches.extend(epoch)
            last = len(epoch)
        return batches, last
    # one stream of passes, each drawn when the samples left in it fill no batch (a client
    # smaller than a batch: one pass a step); the batches cut from it (counted in ints,
    # the tensors joined once)
    drawn: list[torch.Tensor] = []
    cuts: list[tuple[int, int]] = []
    have = used = 0
    while len(cuts) < units:
        while have - used < batch_size:
            drawn.append(order(y, gen))
            have += len(drawn[-1])
            if len(y) < batch_size:
                break
        take = min(batch_size, have - used)
        cuts.append((used, used + take))
        used += take
    stream = torch.cat(drawn) if drawn else torch.empty(0, dtype=torch.long)
    batches = [stream[a:b] for a, b in cuts]
    epoch_len = len(drawn[0]) if drawn else 0
    return batches, min(len(batches), max(1, math.ceil(epoch_len / batch_size)))


def step_budget(sizes: np.ndarray, per_round: int, local_epochs: int, local_steps: int | None,
                batch_size: int) -> int:
    """Expected SGD steps of one federated round (the centralized baseline's budget):
    ``K' S`` when clients take ``S`` local steps, else ``E K' mean_k ceil(n_k / B)``
    (rounded) when they take ``E`` epochs."""
    if local_steps is not None:
        return per_round * local_steps
    batches = float(np.ceil(np.asarray(sizes, dtype=np.float64) / batch_size).mean())
    return max(1, math.floor(local_epochs * per_round * batches + 0.5))
