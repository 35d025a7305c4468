"""Who trains in a round and on which batches: client sampling, stragglers, batch order.

Every random choice is drawn from a generator keyed by (seed, purpose, round[, client]), so a
round's choices do not depend on the order clients are trained in, on the trainer, or on
whether the run was resumed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SAMPLE, STRAGGLE, ORDER, AUGMENT, PROBE, SERVER = range(6)  # SERVER: server-side training


def np_rng(seed: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([seed, *keys])


def torch_gen(seed: int, *keys: int) -> torch.Generator:
    state = np.random.SeedSequence([seed, *keys]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def sample_clients(sizes: np.ndarray, k: int, scheme: str, rng: np.random.Generator
                   ) -> np.ndarray:
    """``k`` distinct clients, with probability proportional to size (``weighted``) or
    uniformly (``uniform``); returned sorted."""
    p = sizes / sizes.sum() if scheme == "weighted" else None
    return np.sort(rng.choice(len(sizes), size=k, replace=False, p=p))


@dataclass(frozen=True)
class Job:
    """One active client's work in a round: ``amount`` epochs (or steps, with local_steps)."""

    client: int
    amount: int
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


def local_batches(order_fn, y: torch.Tensor, amount: int, batch_size: int, by_steps: bool,
                  gen: torch.Generator) -> list[torch.Tensor]:
    """Index batches for one client: ``amount`` epochs of ``order_fn``'s order cut into batches
    of ``batch_size`` (last one partial), or exactly ``amount`` batches cycling epochs."""
    batches: list[torch.Tensor] = []
    if not by_steps:
        for _ in range(amount):
            batches.extend(order_fn(y, gen).split(batch_size))
        return batches
    pending = torch.empty(0, dtype=torch.long)
    while len(batches) < amount:
        while len(pending) < batch_size:
            pending = torch.cat([pending, order_fn(y, gen)])
            if len(y) < batch_size:
                break
        take = min(batch_size, len(pending))
        batches.append(pending[:take])
        pending = pending[take:]
    return batches
