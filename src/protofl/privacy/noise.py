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
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from protofl.privacy.clip import l2_norm


def _noise_like(tensors: Mapping[str, Tensor], std: float,
                generator: torch.Generator | None) -> dict[str, Tensor]:
    return {k: t + std * torch.randn(t.shape, generator=generator, dtype=t.dtype)
            for k, t in tensors.items()}


def noisy_sum(contributions: Sequence[Mapping[str, Tensor]], bound: float, multiplier: float,
              generator: torch.Generator | None = None) -> dict[str, Tensor]:
    """Sum of clipped contributions plus N(0, (multiplier * bound)^2) on every entry. A
    contribution whose norm exceeds ``bound`` is a bug upstream: ValueError."""
    if not contributions:
        raise ValueError("no contributions to sum")
    for i, c in enumerate(contributions):
        if l2_norm(c) > bound * (1 + 1e-5):
            raise ValueError(f"contribution {i} has norm {l2_norm(c):.6g} > bound {bound}: "
                             "clip it first")
    total = {k: sum(c[k] for c in contributions) for k in contributions[0]}
    return _noise_like(total, multiplier * bound, generator)


def client_noise_std(bound: float, multiplier: float, num_clients: int) -> float:
    """The std each of ``num_clients`` clients adds so that their sum carries multiplier*bound."""
    return multiplier * bound / math.sqrt(num_clients)


def add_client_noise(tensors: Mapping[str, Tensor], bound: float, multiplier: float,
                     num_clients: int, generator: torch.Generator | None = None
                     ) -> dict[str, Tensor]:
    """One client's clipped contribution plus its share of the noise."""
    return _noise_like(tensors, client_noise_std(bound, multiplier, num_clients), generator)


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


def private_average(broadcast: Mapping[str, Tensor], local: Sequence[Mapping[str, Tensor]],
                    bound: float, multiplier: float, generator: torch.Generator | None = None,
                    client_side: bool = False) -> tuple[dict[str, Tensor], dict]:
    """DP-FedAvg's model step: W^t + (sum_k clip(W_k - W^t, bound) + noise) / K', the fixed
    denominator K' = len(local) (public). Noise std multiplier*bound on the sum, added by the
    server, or (``client_side``) as K' shares of std multiplier*bound/sqrt(K') added by the
    clients before summing. Returns the new floating-point weights and diagnostics (each
    client's update norm before clipping, and how many were clipped)."""
    from protofl.privacy.clip import clip, weights_delta

    k = len(local)
    if k == 0:
        raise ValueError("no client updates")
    clipped, norms = [], []
    for w in local:
        c, n = clip(weights_delta(w, broadcast), bound)
        norms.append(n)
        if client_side:
            c = add_client_noise(c, bound, multiplier, k, generator)
        clipped.append(c)
    if client_side:
        total = {key: sum(c[key] for c in clipped) for key in clipped[0]}
    else:
        total = noisy_sum(clipped, bound, multiplier, generator)
    new = {key: broadcast[key] + total[key] / k for key in total}
    return new, {"update_norms": norms, "clipped": sum(n > bound for n in norms)}
