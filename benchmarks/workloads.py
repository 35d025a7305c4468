"""The benchmark workloads (importable by Ray's worker processes, unlike ``__main__``)."""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

WORKLOADS = {
    "mlp": {"title": "Synthetic(1,1) MLP", "clients": 30, "steps": 20, "batch": 10},
    "cnn": {"title": "LEAF CNN 28x28", "clients": 10, "steps": 20, "batch": 10, "samples": 100},
}
LR = 0.05
VARIANTS = ("vectorized", "sequential", "loop", "flower")



@cache
def workload(name: str):
    """``(FederatedData, model builder)`` of a workload."""
    from protofl.data.federated import from_client_lists
    from protofl.data.synthetic import synthetic_federation
    from protofl.models.nets import Mlp, leaf_cnn

    w = WORKLOADS[name]
    if name == "mlp":
        data = synthetic_federation(1.0, 1.0, w["clients"], seed=0)
        return data, lambda: Mlp(60, 10)
    g = torch.Generator().manual_seed(0)
    xs = [torch.rand(w["samples"], 1, 28, 28, generator=g) for _ in range(w["clients"])]
    ys = [torch.randint(0, 10, (w["samples"],), generator=g) for _ in range(w["clients"])]
    data = from_client_lists("random28", 10, xs, ys, local_test_fraction=0.0)
    return data, lambda: leaf_cnn((1, 28, 28), 10)


def clients_of(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data, _ = workload(name)
    return [data.client_train(k) for k in range(data.num_clients)]


def local_train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int,
                batch: int) -> None:
    """The usual local loop: a DataLoader, an optimizer, ``steps`` batches."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)
    it = iter(loader)
    model.train()
    for _ in range(steps):
        try:
            xb, yb = next(it)
        except StopIteration:
            it = iter(loader)
            xb, yb = next(it)
        opt.zero_grad()
        _, logits = model(xb)
        F.cross_entropy(logits, yb).backward()
        opt.step()


