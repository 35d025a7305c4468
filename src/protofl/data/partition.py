"""Partitioners: each takes labels and a seeded generator and returns per-client index arrays.

A plugin scheme (``data.partition`` naming an entry point of ``protofl.partitions`` or an
import path) is a function ``(y, num_clients, rng, data_config) -> list of index arrays``."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from protofl import plugins
from protofl.errors import ProtoflError


def power_law_sizes(total: int, num_clients: int, gamma: float, min_size: int,
                    rng: np.random.Generator) -> np.ndarray:
    """Client sizes drawn from a power law with density ∝ n^(-gamma), summing to ``total``."""
    if gamma <= 1:
        raise ProtoflError(f"power-law exponent gamma must be > 1, got {gamma}")
    if total < num_clients * min_size:
        raise ProtoflError(f"{total} samples cannot give {num_clients} clients {min_size} each")
    raw = rng.pareto(gamma - 1.0, num_clients) + 1.0
    spare = total - num_clients * min_size
    sizes = np.floor(raw / raw.sum() * spare).astype(np.int64) + min_size
    sizes[np.argmax(sizes)] += total - sizes.sum()  # rounding leftovers go to the largest
    return sizes


def iid(y: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle and deal the samples into equal shares."""
    return [np.sort(p) for p in np.array_split(rng.permutation(len(y)), num_clients)]


def classes_per_client(y: np.ndarray, num_clients: int, k: int, rng: np.random.Generator,
                       gamma: float = 3.0, min_size: int = 10) -> list[np.ndarray]:
    """The seed's MNIST scheme: ``k`` classes per client, power-law client sizes.

    Client ``i`` holds classes ``(i, i+1, ..., i+k-1) mod C`` (every class equally often);
    its samples are split evenly over them and drawn without replacement from each class pool,
    recycling a pool only when it is exhausted.
    """
    classes = np.unique(y)
    if not 1 <= k <= len(classes):
        raise ProtoflError(f"classes_per_client must be in 1..{len(classes)}, got {k}")
    sizes = power_law_sizes(len(y), num_clients, gamma, min_size, rng)
    pools = {c: list(rng.permutation(np.flatnonzero(y == c))) for c in classes}
    cursor = dict.fromkeys(classes, 0)
    parts = []
    for i, size in enumerate(sizes):
        mine = classes[(i + np.arange(k)) % len(classes)]
        idx = []
        for j, c in enumerate(mine):
            want = size // k + (1 if j < size % k else 0)
            pool = pools[c]
            take = [pool[(cursor[c] + t) % len(pool)] for t in range(min(want, len(pool)))]
            cursor[c] += len(take)
            idx.extend(take)
        parts.append(np.sort(np.unique(np.asarray(idx, dtype=np.int64))))
    return parts


def dirichlet(y: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator,
              min_size: int = 2) -> list[np.ndarray]:
    """Label skew: each class is split over clients in Dirichlet(alpha) proportions.

    Redrawn (up to 100 times) until every client holds at least ``min_size`` samples.
    """
    if alpha <= 0:
        raise ProtoflError(f"dirichlet alpha must be > 0, got {alpha}")
    for _ in range(100):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for c in np.unique(y):
            idx = rng.permutation(np.flatnonzero(y == c))
            q = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(q)[:-1] * len(idx)).astype(np.int64)
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise ProtoflError(f"dirichlet alpha={alpha} leaves some of {num_clients} clients with fewer "
                       f"than {min_size} samples; raise alpha or lower the client count")


def dirichlet_powerlaw(y: np.ndarray, num_clients: int, alpha: float, gamma: float,
                       rng: np.random.Generator, min_size: int = 2) -> list[np.ndarray]:
    """The seed's Pascal scheme: client sizes follow a power law (exponent ``gamma``) and each
    client's class mix is Dirichlet(alpha); samples are drawn without replacement, and a class
    whose pool is empty is dropped from the mix of the clients that come after."""
    if alpha <= 0:
        raise ProtoflError(f"dirichlet alpha must be > 0, got {alpha}")
    classes = np.unique(y)
    sizes = power_law_sizes(len(y), num_clients, gamma, min_size, rng)
    pools = [list(rng.permutation(np.flatnonzero(y == c))) for c in classes]
    parts = []
    for size in sizes:
        q = rng.dirichlet(np.full(len(classes), alpha))
        idx: list[int] = []
        while len(idx) < size:
            left = np.array([len(p) for p in pools], dtype=float)
            if left.sum() == 0:
                break
            w = q * (left > 0)
            w = w / w.sum() if w.sum() > 0 else left / left.sum()
            c = rng.choice(len(classes), p=w)
            idx.append(pools[c].pop())
        parts.append(np.sort(np.asarray(idx, dtype=np.int64)))
    return parts


def partition(y: np.ndarray, scheme: str, num_clients: int, seed: int, *, alpha: float = 0.5,
              gamma: float = 3.0, classes: int = 2, min_size: int = 2) -> list[np.ndarray]:
    """Dispatch by name: iid, classes (k per client), dirichlet, dirichlet_powerlaw."""
    if num_clients < 1 or num_clients > len(y):
        raise ProtoflError(f"num_clients must be in 1..{len(y)} for this pool, got {num_clients}")
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        return iid(y, num_clients, rng)
    if scheme == "classes":
        return classes_per_client(y, num_clients, classes, rng, gamma, min_size)
    if scheme == "dirichlet":
        return dirichlet(y, num_clients, alpha, rng, min_size)
    if scheme == "dirichlet_powerlaw":
        return dirichlet_powerlaw(y, num_clients, alpha, gamma, rng, min_size)
    raise ProtoflError(f"unknown partition {scheme!r}; allowed: {', '.join(SCHEMES)}")


SCHEMES = ("iid", "classes", "dirichlet", "dirichlet_powerlaw")


def plugin_scheme(name: str) -> Callable[..., list[np.ndarray]]:
    """The function ``(y, num_clients, rng, cfg) -> index arrays`` of partition plugin ``name``
    (an installed entry point of ``protofl.partitions`` or an import path)."""
    fn = plugins.load("partition", name, {})
    if not callable(fn):
        raise ProtoflError(f"partition {name!r} is a {type(fn).__name__}, not a function "
                           "(y, num_clients, rng, data_config) -> list of index arrays")
    return fn


def check_scheme(name: str | None) -> None:
    """One line unless ``name`` (``data.partition``) is a built-in scheme or a plugin's."""
    if name is not None and name not in SCHEMES:
        plugin_scheme(name)


def validate_parts(parts: object, n: int, num_clients: int, name: str) -> list[np.ndarray]:
    """``parts`` as a partition of ``n`` rows into ``num_clients`` clients (sorted int64 index
    arrays, disjoint, each non-empty and within range), else one line naming ``name``."""
    if not isinstance(parts, (list, tuple)) or len(parts) != num_clients:
        got = len(parts) if isinstance(parts, (list, tuple)) else type(parts).__name__
        raise ProtoflError(f"partition {name!r} returned {got} parts for {num_clients} clients")
    out, seen = [], np.zeros(n, dtype=bool)
    for k, part in enumerate(parts):
        idx = np.asarray(part)
        if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
            raise ProtoflError(f"partition {name!r}: client {k}'s part is not a 1-d array of "
                               "integer indices")
        if len(idx) == 0:
            raise ProtoflError(f"partition {name!r}: client {k} gets no sample")
        if idx.min() < 0 or idx.max() >= n:
            raise ProtoflError(f"partition {name!r}: client {k} holds an index outside 0..{n - 1}")
        if seen[idx].any() or len(np.unique(idx)) != len(idx):
            raise ProtoflError(f"partition {name!r}: client {k} holds a sample twice or one "
                               "another client holds")
        seen[idx] = True
        out.append(np.sort(idx.astype(np.int64)))
    return out


def config_partition(y: np.ndarray, cfg, scheme: str, clients: int) -> list[np.ndarray]:
    """The partition a ``DataConfig`` asks for: its scheme and client count, or the dataset's
    defaults ``scheme`` and ``clients``; every client gets at least
    ``max(1, min(10, n / 2K))`` samples (a plugin's scheme: its own rule, checked)."""
    k = cfg.num_clients or clients
    name = cfg.partition or scheme
    if name not in SCHEMES:
        if k < 1 or k > len(y):
            raise ProtoflError(f"num_clients must be in 1..{len(y)} for this pool, got {k}")
        parts = plugin_scheme(name)(y, k, np.random.default_rng(cfg.seed), cfg)
        return validate_parts(parts, len(y), k, name)
    return partition(y, name, k, cfg.seed, alpha=cfg.alpha, gamma=cfg.gamma,
                     classes=cfg.classes_per_client,
                     min_size=max(1, min(10, len(y) // (2 * max(k, 1)))))


def capped(n: int, cfg) -> np.ndarray:
    """Rows kept of a pool of ``n``: all, or a seeded random ``cfg.max_samples`` (sorted)."""
    if cfg.max_samples is None or cfg.max_samples >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(cfg.seed).permutation(n)[:cfg.max_samples])
