"""Bounding one client's contribution (its L2 sensitivity) before noise is added.

- Model update: the weights delta W_k - W^t over all tensors, flattened, scaled so that its L2
  norm is at most C (``clip``).
- Prototype statistics (``clip_prototypes``): raw per-class counts n_k[c] have no bound (a
  client may hold any number of samples), so a client contributes class *fractions*
  f[c] = n_k[c] / n_k (f >= 0, sum 1, hence ||f||_2 <= 1) and fraction-weighted prototypes
  s[c] = f[c] * clip(p_k[c], C_p), each class vector clipped to norm C_p. Then
  ||s||_F^2 = sum_c f[c]^2 ||clip(p[c])||^2 <= C_p^2 sum_c f[c]^2 <= C_p^2: the pair (s, f) has
  L2 norms at most (C_p, 1). The server's estimate of class c is sum_k s_k[c] / sum_k f_k[c]:
  each client weighs a class by its share of the client's data rather than by its raw count.
  The same holds for any leading shape, e.g. fedproin's (C, M, d) prototypes with influence
  counts I_k[c, m].
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor


def l2_norm(tensors: Mapping[str, Tensor] | Iterable[Tensor]) -> float:
    """The L2 norm of all entries of ``tensors`` taken as one flat vector."""
    values = tensors.values() if isinstance(tensors, Mapping) else tensors
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in values)))


def clip(tensors: Mapping[str, Tensor], bound: float) -> tuple[dict[str, Tensor], float]:
    """``tensors`` scaled by min(1, bound / norm) as one vector, and the norm before clipping."""
    if bound <= 0:
        raise ValueError(f"clipping bound must be > 0, got {bound}")
    norm = l2_norm(tensors)
    scale = min(1.0, bound / norm) if norm > 0 else 1.0
    return {k: t * scale for k, t in tensors.items()}, norm


def class_fractions(counts: Tensor) -> Tensor:
    """``n / sum n`` over every entry of ``counts`` (zeros when the client holds no sample):
    the bounded form of a client's counts (non-negative, sum 1, L2 norm <= 1)."""
    counts = counts.clamp_min(0)
    total = counts.sum()
    return counts / total if total > 0 else torch.zeros_like(counts)


def clip_prototypes(protos: Tensor, counts: Tensor, bound: float) -> tuple[Tensor, Tensor]:
    """(fraction-weighted clipped prototypes s, class fractions f) with ||s||_F <= bound and
    ||f||_2 <= 1; ``protos`` is (..., d), ``counts`` (...) non-negative (classes the client does
    not hold have count 0 and contribute nothing)."""
    if bound <= 0:
        raise ValueError(f"clipping bound must be > 0, got {bound}")
    if protos.shape[:-1] != counts.shape:
        raise ValueError(f"prototypes {tuple(protos.shape)} do not match counts "
                         f"{tuple(counts.shape)}")
    frac = class_fractions(counts.to(protos.dtype))
    norms = protos.norm(dim=-1, keepdim=True)
    scale = torch.where(norms > bound, bound / norms.clamp_min(1e-30), torch.ones_like(norms))
    return frac.unsqueeze(-1) * (protos * scale), frac
