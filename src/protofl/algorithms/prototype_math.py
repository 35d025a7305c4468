"""Prototype math shared by every algorithm: class means, min-max normalisation, semantic
prototype margins, count-weighted aggregation and nearest-prototype influence counts."""

from __future__ import annotations

import contextlib

import torch

EPS = 1e-8


def class_means(z: torch.Tensor, y: torch.Tensor, num_classes: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class mean feature ``(C, d)`` and per-class count ``(C,)``; absent classes are 0."""
    sums, counts = class_sums(z, y, num_classes)
    return sums / counts.clamp_min(1).unsqueeze(1), counts


def class_sums(z: torch.Tensor, y: torch.Tensor, num_classes: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class sum of the rows of ``z (n, d)`` ``(C, d)`` and per-class count ``(C,)``
    (what class means are accumulated from, a batch at a time). On CUDA the sums are one
    matrix product (``onehot_sums``), whose order of additions is fixed, instead of
    ``index_add_``'s atomic adds, whose order varies from run to run."""
    counts = torch.bincount(y, minlength=num_classes).to(z.dtype)
    if z.is_cuda:
        return onehot_sums(z, y, num_classes), counts
    sums = torch.zeros(num_classes, z.shape[1], dtype=z.dtype, device=z.device)
    sums.index_add_(0, y, z)
    return sums, counts


def onehot_sums(z: torch.Tensor, y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``(C, d)`` per-class sums of the rows of ``z (n, d)`` as ``onehot(y)^T z``, in ``z``'s
    dtype (autocast off: bf16 features are summed as bf16 products, accumulated wider)."""
    onehot = torch.nn.functional.one_hot(y, num_classes).to(z.dtype)
    with full_precision(z.device):
        return onehot.T @ z


def minmax(p: torch.Tensor, present: torch.Tensor, mode: str = "class",
           eps: float = EPS) -> torch.Tensor:
    """Min-max normalise prototypes ``(C, d)``.

    ``class``: over the d channels of each class vector (the seed's choice);
    ``channel``: each channel across the present classes. Absent rows are left as zeros.
    """
    if mode == "class":
        lo = p.min(dim=1, keepdim=True).values
        hi = p.max(dim=1, keepdim=True).values
    elif mode == "channel":
        rows = p[present] if present.any() else p
        lo = rows.min(dim=0, keepdim=True).values
        hi = rows.max(dim=0, keepdim=True).values
    else:
        raise ValueError(f"unknown normalisation {mode!r}")
    out = (p - lo) / (hi - lo + eps)
    return torch.where(present.unsqueeze(1), out, torch.zeros_like(out))


def full_precision(device: torch.device):
    """A context where autocast is off on ``device`` (nothing changes where it is not on)."""
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def pairwise_distance(a: torch.Tensor, b: torch.Tensor, metric: str = "euclidean"
                      ) -> torch.Tensor:
    """``(n, d) x (m, d) -> (n, m)`` Euclidean distance or cosine distance (1 - cos), in at
    least float32 (mixed-precision features meet float32 prototypes)."""
    dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    a, b = a.to(dtype), b.to(dtype)
    if metric == "euclidean":
        with full_precision(a.device):
            return torch.cdist(a.unsqueeze(0), b.unsqueeze(0)).squeeze(0)
    if metric == "cosine":
        an = a / a.norm(dim=1, keepdim=True).clamp_min(EPS)
        bn = b / b.norm(dim=1, keepdim=True).clamp_min(EPS)
        return 1.0 - an @ bn.T
    raise ValueError(f"unknown distance {metric!r}")


def margins(p_hat: torch.Tensor, q_hat: torch.Tensor, present_p: torch.Tensor,
            present_q: torch.Tensor, metric: str = "euclidean"
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``d+[c] = dist(p̂[c], q̂[c])`` and ``d-[c] = min_{c' != c, c' in Q} dist(p̂[c], q̂[c'])``.

    Classes absent from P, or with no counterpart in Q, get NaN.
    """
    dist = pairwise_distance(p_hat, q_hat, metric)
    eye = torch.eye(len(p_hat), dtype=torch.bool, device=p_hat.device)
    nan = torch.tensor(float("nan"), dtype=dist.dtype, device=dist.device)
    d_plus = torch.where(present_p & present_q, dist.diagonal(), nan)
    others = dist.masked_fill(eye | ~present_q.unsqueeze(0), float("inf"))
    d_minus = others.min(dim=1).values
    d_minus = torch.where(present_p & torch.isfinite(d_minus), d_minus, nan)
    return d_plus, d_minus


def spm(p: torch.Tensor, q: torch.Tensor, present_p: torch.Tensor, present_q: torch.Tensor,
        norm: str = "class", metric: str = "euclidean") -> torch.Tensor:
    """Semantic prototype margin ``SPM(P, Q)[c] = d-[c] - d+[c]`` on normalised prototypes
    (NaN where undefined)."""
    d_plus, d_minus = margins(minmax(p, present_p, norm), minmax(q, present_q, norm),
                              present_p, present_q, metric)
    return d_minus - d_plus


def aggregate_prototypes(protos: torch.Tensor, counts: torch.Tensor, previous: torch.Tensor
                         ) -> torch.Tensor:
    """``P[c] = sum_k n_k[c] p_k[c] / sum_k n_k[c]``; a class no client holds keeps ``previous``.

    ``protos`` is ``(K, C, d)``, ``counts`` ``(K, C)``, ``previous`` ``(C, d)``.
    """
    w = counts.to(protos.dtype)
    total = w.sum(0)
    mean = (w.unsqueeze(2) * protos).sum(0) / total.clamp_min(EPS).unsqueeze(1)
    return torch.where((total > 0).unsqueeze(1), mean, previous)


def nearest_prototype_counts(z: torch.Tensor, protos: torch.Tensor) -> torch.Tensor:
    """Influence: how many rows of ``z (n, d)`` have each ``(c, m)`` of ``protos (C, M, d)`` as
    their nearest prototype over all classes; returns ``(C, M)``."""
    c, m, d = protos.shape
    dist = pairwise_distance(z, protos.reshape(c * m, d)).reshape(len(z), c, m)
    return nearest_hits(dist, torch.ones(len(z), dtype=z.dtype, device=z.device))


def nearest_hits(dist: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum_i w_i [argmin_{c,m} dist[i, c, m] = (c, m)]`` for ``dist (n, C, M)``: weighted
    nearest-prototype counts ``(C, M)`` (vmap-able: no bincount)."""
    n, c, m = dist.shape
    nearest = dist.reshape(n, c * m).argmin(dim=1)
    hits = (nearest.unsqueeze(1) == torch.arange(c * m, device=dist.device)).to(w.dtype)
    return (hits * w.unsqueeze(1)).sum(0).reshape(c, m)
