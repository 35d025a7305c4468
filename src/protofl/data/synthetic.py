"""Synthetic(alpha, beta), the FedProx recipe, as specified in ALGORITHMS.md."""

from __future__ import annotations

import numpy as np
import torch


def generate_synthetic(alpha: float = 1.0, beta: float = 1.0, num_clients: int = 30,
                       dim: int = 60, num_classes: int = 10, seed: int = 0,
                       ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-client (x, y) arrays.

    n_k = int(lognormal(4, 2)) + 50; u_k ~ N(0, alpha); W_k ~ N(u_k, 1) in R^{dim x C};
    b_k ~ N(u_k, 1); B_k ~ N(0, beta); v_k ~ N(B_k, 1) in R^dim; x ~ N(v_k, diag(j^-1.2));
    y = argmax softmax(x W_k + b_k). alpha and beta are standard deviations, as in the FedProx
    authors' generator (identical for the default alpha = beta = 1).
    """
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(4, 2, num_clients).astype(np.int64) + 50
    std = np.arange(1, dim + 1, dtype=np.float64) ** (-1.2 / 2)  # sqrt of the diagonal of Sigma
    xs, ys = [], []
    for k in range(num_clients):
        u = rng.normal(0, alpha)
        w = rng.normal(u, 1, (dim, num_classes))
        b = rng.normal(u, 1, num_classes)
        big_b = rng.normal(0, beta)
        v = rng.normal(big_b, 1, dim)
        x = rng.normal(v, std, (sizes[k], dim))
        y = np.argmax(x @ w + b, axis=1)  # softmax is monotone: argmax of the logits
        xs.append(x.astype(np.float32))
        ys.append(y.astype(np.int64))
    return xs, ys


def synthetic_federation(alpha: float = 1.0, beta: float = 1.0, num_clients: int = 30,
                         seed: int = 0):
    """Synthetic(alpha, beta) as a FederatedData with the 90/10 per-client split."""
    from protofl.data.federated import from_client_lists

    xs, ys = generate_synthetic(alpha, beta, num_clients, seed=seed)
    return from_client_lists(
        f"synthetic({alpha:g},{beta:g})", 10,
        [torch.from_numpy(x) for x in xs], [torch.from_numpy(y) for y in ys], seed=seed,
    )
