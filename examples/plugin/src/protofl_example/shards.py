"""McMahan et al.'s (2017) pathological non-IID split: rows sorted by label, cut into
``2 K`` shards of equal size, two random shards per client."""

from __future__ import annotations

import numpy as np


def shards(y: np.ndarray, num_clients: int, rng: np.random.Generator, cfg) -> list[np.ndarray]:
    """protofl's partition function: client k's row indices (``cfg``: the data section)."""
    order = np.argsort(y, kind="stable")
    pieces = np.array_split(order, 2 * num_clients)
    deal = rng.permutation(2 * num_clients)
    return [np.sort(np.concatenate([pieces[deal[2 * k]], pieces[deal[2 * k + 1]]]))
            for k in range(num_clients)]
