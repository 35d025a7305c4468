"""Calibrated Gaussian noise for sums of clipped contributions.

The noise multiplier sigma is the noise std divided by the L2 bound C of one client's
contribution. Server-side, the server adds N(0, (sigma C)^2) to each entry of the sum of the
clipped contributions. Client-side (for secure aggregation, where the server sees only the
sum), each of the K' clients adds N(0, (sigma C)^2 / K'), so the sum carries std sigma C again;
if only K'' < K' of them arrive, the sum carries sigma C sqrt(K''/K') (``distributed_multiplier``)
and the accountant must be told.

The noise itself comes from the operating system's CSPRNG (``os.urandom``) by default
(:class:`OsEntropy`, :func:`noise_source`): nothing a run logs, publishes or checkpoints can
regenerate it. ``privacy.reproducible_noise`` draws it from the run seed instead, for tests
only: anyone holding the run's config could then strip it, and the run is flagged as not
private.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np
import torch

from protofl.seeding import torch_gen


class OsEntropy:
    """A source of Gaussian noise read from the operating system's CSPRNG on every draw; it
    holds no state (nothing to log, seed or checkpoint)."""

    def __repr__(self) -> str:
        return "OsEntropy()"


NoiseSource = torch.Generator | OsEntropy | None


def noise_source(reproducible: bool, seed: int, *keys: int) -> NoiseSource:
    """Where one draw of DP noise comes from: the OS's CSPRNG, or (``reproducible``, tests
    only) a generator keyed by ``(seed, *keys)`` that anyone knowing the seed can rebuild."""
    return torch_gen(seed, *keys) if reproducible else OsEntropy()


def gaussian(shape: Sequence[int], dtype: torch.dtype, source: NoiseSource) -> torch.Tensor:
    """Standard normal samples of ``shape`` on the CPU: Box-Muller over 53-bit uniforms from
    ``os.urandom`` for :class:`OsEntropy`, else ``torch.randn`` with the generator."""
    if not isinstance(source, OsEntropy):
        return torch.randn(tuple(shape), generator=source, dtype=dtype)
    n = math.prod(shape)
    m = (n + 1) // 2
    bits = np.frombuffer(os.urandom(16 * m), dtype=np.uint64) >> np.uint64(11)
    u = bits.astype(np.float64) * 2.0 ** -53  # [0, 1) on a grid of 2^-53
    radius = np.sqrt(-2.0 * np.log1p(-u[:m]))  # 1 - u in (0, 1]: a finite radius
    angle = 2.0 * math.pi * u[m:]
    z = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:n]
    return torch.from_numpy(z.reshape(tuple(shape))).to(dtype)


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
