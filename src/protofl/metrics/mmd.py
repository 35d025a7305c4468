"""MMD² between two feature sets and the seed's feature-fidelity difference (FFD).

Kernel: Gaussian, ``k(a, b) = exp(-||a - b||² / (2 σ²))``. Bandwidth (the median heuristic,
as used here): ``σ`` = the median of the Euclidean distances ``||z_i - z_j||`` (not squared)
over all distinct pairs ``i < j`` of the pooled sample ``Z = X ∪ Y`` (for an even number of
pairs, the mean of the two middle distances). When more than half of those distances are
zero the median of the non-zero ones is used; when all are zero the two sets are one
repeated point and MMD² is 0.

Estimators, with ``m = |X|``, ``n = |Y|``:
- ``biased`` (V-statistic): ``mean K_XX + mean K_YY - 2 mean K_XY`` over all pairs, diagonal
  included; never negative, 0 for identical sets.
- ``unbiased`` (U-statistic): the diagonals of ``K_XX`` and ``K_YY`` left out
  (``/ m(m-1)`` and ``/ n(n-1)``); can be slightly negative; needs ``m, n >= 2``.

One ``cdist`` over the pooled sample per call, in float64 (by matrix products: a distance
is off by about 1e-8 times the features' norm, far below any bandwidth).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from protofl import device as devices
from protofl.algorithms.base import Tensors, features
from protofl.errors import ProtoflError

ESTIMATORS = ("biased", "unbiased")


def median_bandwidth(dist: torch.Tensor) -> float:
    """``σ`` of the median heuristic from the pooled pairwise distance matrix ``dist``
    (0 when every distance is 0)."""
    iu = torch.triu_indices(len(dist), len(dist), offset=1)
    d = dist[iu[0], iu[1]]
    if len(d) == 0:
        return 0.0
    d = d.numpy()
    sigma = float(np.median(d))  # the mean of the two middle values for an even count
    if sigma == 0.0:
        nonzero = d[d > 0]
        sigma = float(np.median(nonzero)) if len(nonzero) else 0.0
    return sigma


def mmd2(x: torch.Tensor, y: torch.Tensor, estimator: str = "biased",
         bandwidth: float | None = None) -> float:
    """MMD² between the rows of ``x (m, d)`` and ``y (n, d)`` with a Gaussian kernel
    (``bandwidth`` = σ; ``None``: the median heuristic on the pooled sample)."""
    if estimator not in ESTIMATORS:
        raise ProtoflError(f"mmd: estimator {estimator!r} unknown; allowed: "
                           f"{', '.join(ESTIMATORS)}")
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[1]:
        raise ProtoflError(f"mmd: features must be (n, d) with the same d, got "
                           f"{tuple(x.shape)} and {tuple(y.shape)} (flatten per-pixel maps "
                           "with feature_rows)")
    m, n = len(x), len(y)
    need = 2 if estimator == "unbiased" else 1
    if m < need or n < need:
        raise ProtoflError(f"mmd: the {estimator} estimator needs at least {need} sample(s) "
                           f"per set, got {m} and {n}")
    z = torch.cat([x, y]).double()
    dist = torch.cdist(z, z, compute_mode="use_mm_for_euclid_dist")  # 10x the direct way
    dist.fill_diagonal_(0.0)
    sigma = median_bandwidth(dist) if bandwidth is None else float(bandwidth)
    if sigma <= 0.0:
        if bandwidth is not None:
            raise ProtoflError(f"mmd: bandwidth must be > 0, got {bandwidth}")
        return 0.0  # every pooled point coincides
    k = torch.exp(-dist.pow(2) / (2.0 * sigma ** 2))
    kxx, kyy, kxy = k[:m, :m], k[m:, m:], k[:m, m:]
    if estimator == "biased":
        return float(kxx.mean() + kyy.mean() - 2.0 * kxy.mean())
    sxx = (kxx.sum() - kxx.diagonal().sum()) / (m * (m - 1))
    syy = (kyy.sum() - kyy.diagonal().sum()) / (n * (n - 1))
    return float(sxx + syy - 2.0 * kxy.mean())


def ffd(mmd_a: float, mmd_b: float) -> float:
    """FFD(A, B) = 100 (MMD_B - MMD_A) / MMD_B: how much closer (in %) method A's features
    are to the central model's than method B's. NaN when ``MMD_B`` is not positive."""
    if not (mmd_b > 0) or not np.isfinite(mmd_a):
        return float("nan")
    return 100.0 * (mmd_b - mmd_a) / mmd_b


def probe_indices(total: int, size: int, seed: int) -> np.ndarray:
    """A fixed, seeded, sorted probe subset of ``size`` of ``range(total)`` (all if fewer)."""
    if size >= total:
        return np.arange(total)
    return np.sort(np.random.default_rng(seed).choice(total, size, replace=False))


def feature_rows(z: torch.Tensor, max_rows: int | None = None, seed: int = 0) -> torch.Tensor:
    """Features as rows: ``(N, d)`` unchanged, per-pixel maps ``(N, d, H, W)`` as
    ``(N·H·W, d)``; with ``max_rows``, a seeded subset of rows (the same rows for every model
    given the same shape and seed, so two models are compared at the same locations)."""
    if z.ndim == 4:
        z = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
    elif z.ndim != 2:
        raise ProtoflError(f"mmd: features must be (N, d) or (N, d, H, W), got {tuple(z.shape)}")
    if max_rows is not None and len(z) > max_rows:
        z = z[torch.from_numpy(probe_indices(len(z), max_rows, seed))]
    return z


@torch.no_grad()
def model_features(model: torch.nn.Module, params: Tensors, buffers: Tensors, x: torch.Tensor,
                   batch: int = 1024) -> torch.Tensor:
    """Encoder features ``z`` of ``x`` under the given weights (eval mode, batched), computed
    on the model's device and returned on the CPU."""
    dev = devices.model_device(model)
    params, buffers = devices.to_device(params, dev), devices.to_device(buffers, dev)
    model.eval()
    return features(model, params, buffers, x.to(dev), batch).cpu()


def mean_client_mmd(model: torch.nn.Module, clients: Sequence[tuple[Tensors, Tensors]],
                    reference: tuple[torch.nn.Module, Tensors, Tensors], probe_x: torch.Tensor,
                    estimator: str = "biased", max_rows: int | None = None,
                    batch: int = 1024) -> float:
    """MMD_A of one round: the mean over clients (``(params, buffers)`` of each active
    client's model) of MMD² between its features and the reference (centrally trained)
    model's features on the same probe inputs ``probe_x``."""
    if not clients:
        raise ProtoflError("mmd: no client models to compare with the reference")
    ref_model, ref_params, ref_buffers = reference
    probe_x = probe_x.to(devices.model_device(model))  # once, not once per client
    ref = feature_rows(model_features(ref_model, ref_params, ref_buffers, probe_x, batch),
                       max_rows)
    vals = [mmd2(feature_rows(model_features(model, p, b, probe_x, batch), max_rows), ref,
                 estimator) for p, b in clients]
    return float(np.mean(vals))
