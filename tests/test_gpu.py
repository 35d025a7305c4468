"""On a CUDA machine: every algorithm, with both trainers, runs a two-round experiment on the
GPU and on the CPU with the same results up to the devices' arithmetic. Marked ``gpu`` and
skipped without CUDA (``pytest -m gpu`` runs only these; benchmarks/gpu.sh runs them)."""

from __future__ import annotations

import math

import pytest
import torch

from protofl.algorithms.registry import ALGORITHMS
from protofl.config import config_from_dict
from protofl.engine.experiment import Experiment

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA device")]

# fedplvm's default lambda turns rounding differences into visible ones within two rounds
# (see test_vectorized.py); fedtgp's server training is shortened
ALGO = {"fedplvm": {"lam": 1.0}, "fedtgp": {"server_epochs": 5}}
FIGURES = ("accuracy", "loss", "client_loss", "local_accuracy", "train_loss", "amm")


@pytest.fixture(autouse=True)
def _exact_cuda_arithmetic():
    """No TF32 in convolutions and matmuls, deterministic cuDNN: CPU and GPU then differ by
    rounding only."""
    old = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
           torch.backends.cudnn.deterministic)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    yield
    (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
     torch.backends.cudnn.deterministic) = old


def run(algorithm: str, trainer: str, device: str, precision: str = "fp32") -> Experiment:
    cfg = config_from_dict({
        "algorithm": algorithm, "rounds": 2, "checkpoint_every": 0, "trainer": trainer,
        "device": device, "precision": precision,
        "data": {"name": "digits", "num_clients": 6},
        "clients": {"per_round": 3, "local_steps": 3},
        "metrics": {"dissimilarity_clients": 3, "dissimilarity_exact": algorithm == "fedavg"},
        "algo": ALGO.get(algorithm, {})})
    exp = Experiment(cfg)
    exp.summary_ = exp.run()
    return exp


@pytest.mark.parametrize("trainer", ["sequential", "vectorized"])
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_cpu_and_cuda_agree(name, trainer):
    cpu, gpu = run(name, trainer, "cpu"), run(name, trainer, "cuda")
    assert gpu.summary_["device"].startswith("cuda")
    for key in FIGURES + ("dissimilarity",):
        a, b = cpu.summary_.get(key), gpu.summary_.get(key)
        assert (a is None) == (b is None), key
        if isinstance(a, float) and math.isfinite(a):
            assert b == pytest.approx(a, rel=1e-3, abs=1e-4), key
    for k, v in cpu.state.get("params", {}).items():
        assert torch.allclose(v, gpu.state["params"][k].cpu(), rtol=1e-3, atol=1e-4), k
    snap = gpu.snapshot()
    assert all(t.device.type == "cpu" for t in _tensors(snap))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_on_cuda(precision):
    fp32 = run("fedavg", "vectorized", "cuda")
    got = run("fedavg", "vectorized", "cuda", precision)
    assert got.summary_["loss"] == pytest.approx(fp32.summary_["loss"], abs=0.05)


def _tensors(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)
    elif isinstance(tree, torch.Tensor):
        yield tree


@pytest.mark.parametrize("trainer", ["sequential", "vectorized"])
@pytest.mark.parametrize("name", ["fedavg", "fedmargin"])
def test_segmentation_on_cpu_and_cuda_agree(name, trainer):
    raw = {"algorithm": name, "rounds": 2, "checkpoint_every": 0, "trainer": trainer,
           "data": {"name": "shapes", "image_size": 16, "num_clients": 4, "max_samples": 80},
           "model": {"width": 0.25, "seg_channels": 8},
           "clients": {"per_round": 2, "local_steps": 2, "batch_size": 4},
           "metrics": {"dissimilarity_clients": 2, "dissimilarity_rows": 4,
                       "train_loss_samples": 20, "eval_batch": 16, "every": 1}}
    cpu, gpu = (Experiment(config_from_dict({**raw, "device": d})).run() for d in ("cpu", "cuda"))
    for key in ("miou", "pixel_accuracy", "loss", "train_loss", "amm", "dissimilarity"):
        assert gpu[key] == pytest.approx(cpu[key], rel=1e-3, abs=1e-4), key

