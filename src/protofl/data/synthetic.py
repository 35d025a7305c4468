"""Synthetic(alpha, beta), the FedProx recipe (stated in docs/datasets.md)."""

from __future__ import annotations

import numpy as np
import torch

from protofl.data.federated import FederatedData, local_test_size
from protofl.sizes import Need, check

DIM, MIN_SAMPLES = 60, 50  # features of a sample; samples of a client, at least


def _clients(alpha: float, beta: float, num_clients: int, dim: int, num_classes: int,
             seed: int):
    """Client sizes, then a generator of each client's (x float32, y int64) in order."""
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(4, 2, num_clients).astype(np.int64) + MIN_SAMPLES
    std = np.arange(1, dim + 1, dtype=np.float64) ** (-1.2 / 2)  # sqrt of the diagonal of Sigma

    def draws():
        for k in range(num_clients):
            u = rng.normal(0, alpha)
            w = rng.normal(u, 1, (dim, num_classes))
            b = rng.normal(u, 1, num_classes)
            big_b = rng.normal(0, beta)
            v = rng.normal(big_b, 1, dim)
            x = rng.normal(v, std, (sizes[k], dim))
            y = np.argmax(x @ w + b, axis=1)  # softmax is monotone: argmax of the logits
            yield x.astype(np.float32), y.astype(np.int64)

    return sizes, draws()


def generate_synthetic(alpha: float = 1.0, beta: float = 1.0, num_clients: int = 30,
                       dim: int = 60, num_classes: int = 10, seed: int = 0,
                       ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-client (x, y) arrays.

    n_k = int(lognormal(4, 2)) + 50; u_k ~ N(0, alpha); W_k ~ N(u_k, 1) in R^{dim x C};
    b_k ~ N(u_k, 1); B_k ~ N(0, beta); v_k ~ N(B_k, 1) in R^dim; x ~ N(v_k, diag(j^-1.2));
    y = argmax softmax(x W_k + b_k). alpha and beta are standard deviations, as in the FedProx
    authors' generator (identical for the default alpha = beta = 1).
    """
    _, draws = _clients(alpha, beta, num_clients, dim, num_classes, seed)
    xs, ys = zip(*draws)
    return list(xs), list(ys)


def synthetic_federation(alpha: float = 1.0, beta: float = 1.0, num_clients: int = 30,
                         seed: int = 0, local_test_fraction: float = 0.1) -> FederatedData:
    """Synthetic(alpha, beta) as a FederatedData: each client's first ``local_test_size``
    draws (i.i.d., so as good as a random pick) are its local test split, the rest its
    training split. Written straight into the two split tensors, so building 10,000 clients
    needs little more memory than the data."""
    check([Need("data.num_clients", num_clients,
                num_clients * MIN_SAMPLES * (DIM * 4 + 8 + 16),
                f"Synthetic's {num_clients} clients (each at least {MIN_SAMPLES} samples of "
                f"{DIM} features)")])
    sizes, draws = _clients(alpha, beta, num_clients, DIM, 10, seed)
    n_test = np.array([local_test_size(int(n), local_test_fraction) for n in sizes])
    test_offsets = np.concatenate([[0], np.cumsum(n_test)])
    train_offsets = np.concatenate([[0], np.cumsum(sizes - n_test)])
    x_tr = torch.empty(int(train_offsets[-1]), 60)
    y_tr = torch.empty(int(train_offsets[-1]), dtype=torch.long)
    x_te = torch.empty(int(test_offsets[-1]), 60)
    y_te = torch.empty(int(test_offsets[-1]), dtype=torch.long)
    for k, (x, y) in enumerate(draws):
        t = n_test[k]
        x_te[test_offsets[k]:test_offsets[k + 1]] = torch.from_numpy(x[:t])
        y_te[test_offsets[k]:test_offsets[k + 1]] = torch.from_numpy(y[:t])
        x_tr[train_offsets[k]:train_offsets[k + 1]] = torch.from_numpy(x[t:])
        y_tr[train_offsets[k]:train_offsets[k + 1]] = torch.from_numpy(y[t:])
    return FederatedData(f"synthetic({alpha:g},{beta:g})", 10, x_tr, y_tr, train_offsets,
                         x_te, y_te, test_offsets, x_te, y_te)
