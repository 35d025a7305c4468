"""FINCH clustering (Sarfraz, Sharma & Stiefelhagen, CVPR 2019), written for FedPLVM.

Link every point to its first (nearest) neighbour; the connected components of that graph
(``j = kappa_i``, ``i = kappa_j`` or ``kappa_i = kappa_j`` all lie on the edges ``i - kappa_i``)
are the first partition. Then the same step is applied to the cluster means (means of the
original points), giving coarser partitions, until one cluster would remain or nothing merges.
The one-cluster partition is kept only when it is the first one (e.g. two points).
"""

from __future__ import annotations

import torch

from protofl.algorithms import prototype_math

CHUNK = 2048  # rows of the distance matrix computed at once


def first_neighbours(x: torch.Tensor, metric: str = "cosine") -> torch.Tensor:
    """Index of each row's nearest other row, ``(n,)`` (needs n >= 2)."""
    out = []
    for start in range(0, len(x), CHUNK):
        d = prototype_math.pairwise_distance(x[start:start + CHUNK], x, metric)
        rows = torch.arange(len(d), device=d.device)
        d[rows, rows + start] = float("inf")
        out.append(d.argmin(dim=1))
    return torch.cat(out)


def components(neighbour: torch.Tensor) -> torch.Tensor:
    """Connected components of the graph with edges ``i - neighbour[i]``: labels 0..k-1,
    numbered in order of each component's first point (on ``neighbour``'s device)."""
    parent = list(range(len(neighbour)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, j in enumerate(neighbour.tolist()):
        ri, rj = root(i), root(j)
        if ri != rj:
            parent[max(ri, rj)] = min(ri, rj)
    names: dict[int, int] = {}
    return torch.tensor([names.setdefault(root(i), len(names)) for i in range(len(parent))],
                        device=neighbour.device)


def finch(x: torch.Tensor, metric: str = "cosine") -> list[torch.Tensor]:
    """The hierarchy of partitions of the rows of ``x``, finest first: each a ``(n,)`` label
    tensor (labels 0..k-1) over the original rows, each with fewer clusters than the last."""
    n = len(x)
    if n < 2:
        return [torch.zeros(n, dtype=torch.long, device=x.device)]
    partitions: list[torch.Tensor] = []
    labels = torch.arange(n, device=x.device)
    points = x
    while len(points) >= 2:
        merged = components(first_neighbours(points, metric))[labels]
        k = int(merged.max()) + 1
        if k == len(points) or (k == 1 and partitions):
            break
        partitions.append(merged)
        labels = merged
        if k == 1:
            break
        points = prototype_math.class_means(x, labels, k)[0]
    return partitions


def cluster_means(x: torch.Tensor, labels: torch.Tensor, limit: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Means ``(m, d)`` and sizes ``(m,)`` of the clusters, largest first, at most ``limit``
    of them (smaller clusters beyond ``limit`` are dropped)."""
    k = int(labels.max()) + 1
    means, sizes = prototype_math.class_means(x, labels, k)
    order = torch.argsort(-sizes, stable=True)[:limit]
    return means[order], sizes[order]


def select(partitions: list[torch.Tensor], level: str) -> torch.Tensor:
    """``last``: the coarsest partition; ``first``: the finest."""
    return partitions[-1] if level == "last" else partitions[0]
