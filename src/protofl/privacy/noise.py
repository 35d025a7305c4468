"""Calibrated Gaussian noise for sums of clipped contributions.

The noise multiplier sigma is the noise std divided by the L2 bound C of one client's
contribution. Server-side, the server adds N(0, (sigma C)^2) to each entry of the sum of the
clipped contributions. Client-side (for secure aggregation, where the server sees only the
sum), each of the K' clients adds N(0, (sigma C)^2 / K'), so the sum carries std sigma C again;
if only K'' < K' of them arrive, the sum carries sigma C sqrt(K''/K') (``distributed_multiplier``)
and the accountant must be told.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def client_noise_std(bound: float, multiplier: float, num_clients: int) -> float:
    """The std each of ``num_clients`` clients adds so that their sum carries multiplier*bound."""
    return multiplier * bound / math.sqrt(num_clients)


def distributed_multiplier(multiplier: float, expected: int, received: int) -> float:
    """The multiplier the sum really carries when ``received`` of ``expected`` clients, each
    adding its share of client-side noise, arrive."""
    return multiplier * math.sqrt(received / expected)


def effective_multiplier(multipliers: Sequence[float]) -> float:
    """One Gaussian mechanism equivalent to releasing several parts, part i with its own bound
    C_i and noise std sigma_i C_i: (sum_i sigma_i^-2)^(-1/2). (Renyi DP of Gaussians adds up:
    alpha / (2 sigma_i^2) per part.) E.g. weights delta and prototype statistics noised with
    the same sigma give sigma / sqrt(2)."""
    if not multipliers or min(multipliers) <= 0:
        return 0.0
    low = min(multipliers)  # factored out, so extreme values neither overflow nor vanish
    return low / math.sqrt(sum((low / s) ** 2 for s in multipliers))
