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
    # a round of the seed's MNIST protocol as FedAvg (configs/mnist.yaml's federation, local
    # epochs instead of steps: "steps" counts epochs here; no stragglers, no evaluation)
    "mnist-protocol": {"title": "seed's MNIST protocol round (FedAvg), LEAF CNN", "clients": 10,
                       "steps": 20, "batch": 10, "pool": 1000, "epochs": True},
    # DeepLab-V3+ (MobileNetV2 encoder, width 0.5) on the embedded Shapes set at 64 px
    "deeplab": {"title": "DeepLab-V3+ on Shapes 64 px", "clients": 4, "steps": 10, "batch": 8},
}
LR = 0.05
VARIANTS = ("auto", "vectorized", "compiled", "parallel", "sequential", "loop", "flower",
            "floor")
MNIST_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "mnist.yaml"



@cache
def workload(name: str):
    """``(FederatedData, model builder)`` of a workload."""
    from protofl.data.federated import from_client_lists
    from protofl.data.synthetic import synthetic_federation
    from protofl.models.nets import Mlp, leaf_cnn

    w = WORKLOADS[name]
    if name in ("mnist-protocol", "deeplab"):
        return protocol_workload(name)
    if name == "mlp":
        data = synthetic_federation(1.0, 1.0, w["clients"], seed=0)
        return data, lambda: Mlp(60, 10)
    g = torch.Generator().manual_seed(0)
    xs = [torch.rand(w["samples"], 1, 28, 28, generator=g) for _ in range(w["clients"])]
    ys = [torch.randint(0, 10, (w["samples"],), generator=g) for _ in range(w["clients"])]
    data = from_client_lists("random28", 10, xs, ys, local_test_fraction=0.0)
    return data, lambda: leaf_cnn((1, 28, 28), 10)


def protocol_workload(name: str):
    """The federation and model of ``mnist-protocol`` (configs/mnist.yaml's data: the real
    MNIST files where its ``data.root`` holds them, else generated ones of the same shape and
    counts) and ``deeplab`` (Shapes at 64 px, 4 clients)."""
    import shutil
    import tempfile

    from protofl.config import ModelConfig, config_from_dict, load_raw
    from protofl.data.registry import load_dataset
    from protofl.models.nets import leaf_cnn
    from protofl.models.registry import build_model

    if name == "deeplab":
        cfg = config_from_dict({"data": {"name": "shapes", "image_size": 64, "num_clients": 4,
                                         "max_samples": 400}})
        data = load_dataset(cfg.data)
        mc = ModelConfig(name="deeplabv3plus", width=0.5)
        return data, lambda: build_model("deeplabv3plus", data.input_shape, data.num_classes, mc)
    raw = load_raw(str(MNIST_CONFIG))
    if not mnist_files_in(raw["data"]["root"]):  # generated once, shared by Ray's actors
        root = Path(tempfile.gettempdir()) / "protofl-mnist-like"
        if not mnist_files_in(root):
            part = Path(tempfile.mkdtemp(prefix="protofl-mnist-like-", dir=root.parent))
            write_mnist_like(part)
            try:
                part.rename(root)
            except OSError:  # another process got there first
                shutil.rmtree(part, ignore_errors=True)
        raw["data"]["root"] = str(root)
    data = load_dataset(config_from_dict({"data": raw["data"]}).data)
    return data, lambda: leaf_cnn((1, 28, 28), 10)


def mnist_files_in(root) -> bool:
    """Whether ``root`` holds MNIST's four IDX files (plain or gzipped)."""
    from protofl.data.mnist import FILES

    return all((Path(root) / f).exists() or (Path(root) / f"{f}.gz").exists()
               for f in FILES.values())


def active_clients(name: str, t: int) -> list[int]:
    """The clients of round ``t``: every client, or for a workload with a ``pool`` the
    ``clients`` drawn uniformly (seeded by the round, as protofl's runs draw them)."""
    from protofl.engine.schedule import sample_clients
    from protofl.seeding import SAMPLE, np_rng

    w = WORKLOADS[name]
    data, _ = workload(name)
    if "pool" not in w:
        return list(range(data.num_clients))
    return sample_clients(data.train_sizes, w["clients"], "uniform",
                          np_rng(0, SAMPLE, t)).tolist()


def local_steps(name: str, n: int) -> int:
    """Local steps of a client of ``n`` rows: the workload's, or its epochs of batches."""
    w = WORKLOADS[name]
    return w["steps"] * -(-n // w["batch"]) if w.get("epochs") else w["steps"]


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
        loss_of(logits, yb).backward()
        opt.step()


def loss_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of class scores, or per image over its non-void pixels (segmentation)."""
    if y.dim() == 1:
        return F.cross_entropy(logits, y)
    from protofl.tasks import per_sample_cross_entropy

    return per_sample_cross_entropy(logits, y).mean()




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
