"""The benchmark workloads (importable by Ray's worker processes, unlike ``__main__``)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

WORKLOADS = {
    "mlp": {"title": "Synthetic(1,1) MLP", "clients": 30, "steps": 20, "batch": 10},
    "cnn": {"title": "LEAF CNN 28x28", "clients": 10, "steps": 20, "batch": 10, "samples": 100},
}
LR = 0.05
VARIANTS = ("auto", "vectorized", "parallel", "sequential", "loop", "flower", "floor")
MNIST_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "mnist.yaml"



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
                batch: int, device: str = "cpu") -> None:
    """The usual local loop: a DataLoader, an optimizer, ``steps`` batches (moved to the
    model's ``device``)."""
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
        xb, yb = xb.to(device), yb.to(device)
        opt.zero_grad()
        _, logits = model(xb)
        F.cross_entropy(logits, yb).backward()
        opt.step()




def write_mnist_like(root, train: int = 60_000, test: int = 10_000, seed: int = 0) -> None:
    """Generated 28x28 digits in MNIST's four IDX files (uint8; each class a random blurred
    template plus noise), so the ``mnist`` loader builds the seed's federation from them:
    the same file format, sample counts and so client-size distribution as the real files."""
    import numpy as np

    from protofl.data.mnist import FILES

    rng = np.random.default_rng(seed)
    templates = rng.random((10, 28, 28)) ** 3 * 255
    for split, n in (("train", train), ("test", test)):
        y = rng.integers(0, 10, n).astype(np.uint8)
        x = templates[y] * 0.7 + rng.random((n, 28, 28)) * 76
        for kind, arr in (("images", x.astype(np.uint8)), ("labels", y)):
            head = bytes([0, 0, 0x08, arr.ndim]) + b"".join(
                int(d).to_bytes(4, "big") for d in arr.shape)
            (Path(root) / FILES[f"{split}_{kind}"]).write_bytes(head + arr.tobytes())


def mnist_experiment(root, epochs: int, rounds: int = 100, seed: int = 0,
                     metrics: dict | None = None, device: str = "auto"):
    """An ``Experiment`` of the seed's MNIST protocol (configs/mnist.yaml) on the IDX files in
    ``root``, with ``epochs`` local epochs, ``metrics`` overriding ``metrics.*`` and the
    config's defaults otherwise (trainer, workers, threads)."""
    from protofl.config import config_from_dict, load_raw
    from protofl.engine.experiment import Experiment

    raw = load_raw(str(MNIST_CONFIG))
    raw["data"]["root"] = str(root)
    raw["clients"]["local_epochs"] = epochs
    raw.update(seed=seed, rounds=rounds, checkpoint_every=0, device=device)
    raw["metrics"] = {**raw.get("metrics", {}), **(metrics or {})}
    return Experiment(config_from_dict(raw))
