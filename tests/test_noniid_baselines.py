"""SCAFFOLD, FedNova and the adaptive server optimizers on the parallel trainer (bit for bit
with the sequential one, client states included), SCAFFOLD's option I on segmentation masks,
and end to end on tiny Fashion-MNIST files through the CLI (the vectorized trainer,
devices, DP refusals and the Flower simulation cover every registered algorithm in their
own tests)."""

from __future__ import annotations

import json

import pytest
import torch

from protofl.algorithms.registry import make_algorithm
from protofl.algorithms.scaffold import gradient_at
from protofl.cli import main
from protofl.engine.federation import info
from protofl.engine.parallel import ParallelTrainer
from protofl.engine.train import LocalSetup, SequentialTrainer
from tests.test_fashion_mnist import write_fashion
from tests.test_parallel import JOBS, C, conv_model, federation, rounds, same

NAMES = ("scaffold", "fednova", "fedadam", "fedyogi", "fedadagrad")
CASES = {**{n: (n, {}) for n in NAMES}, "scaffold-variate-I": ("scaffold", {"variate": "I"}),
         "fednova-mu": ("fednova", {"mu": 0.1})}


@pytest.mark.parametrize("case", list(CASES))
def test_parallel_equals_sequential_bit_for_bit(case):
    """Stragglers take fewer steps (FedNova's tau_i, SCAFFOLD's K); SCAFFOLD's c_i carry
    from round 1 to round 2 in the workers as in the loop."""
    name, opts = CASES[case]
    data = federation()
    alg = make_algorithm(name, opts, conv_model(), C, info(data))
    setup = LocalSetup(4, False, "sgd", 0.05, 0.9, 1e-3, seed=3)
    want = rounds(SequentialTrainer(), alg, data, setup, JOBS)
    trainer = ParallelTrainer(2, "sequential")
    try:
        got = rounds(trainer, alg, data, setup, JOBS)
    finally:
        trainer.close()
    for w, g in zip(want, got):
        assert [r.client for r in w] == [r.client for r in g]
        for a, b in zip(w, g):
            same(a.upload, b.upload)
            same(a.state, b.state)
            assert a.loss == b.loss


def test_option_i_gradient_on_segmentation_masks():
    """Per-pixel logits: g_i(x) is the gradient of the mean over images of each image's mean
    non-void pixel cross-entropy (the task's per-sample loss)."""
    from torch import nn

    from protofl.algorithms.base import forward
    from protofl.models.nets import ProtoNet

    class PixelNet(ProtoNet):
        def __init__(self):
            super().__init__()
            self.feature_dim = 4
            self.body, self.classifier = nn.Conv2d(1, 4, 1), nn.Conv2d(4, C, 1)

        def encode(self, x):
            return torch.relu(self.body(x))

    torch.manual_seed(0)
    model = PixelNet()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(3, 1, 4, 4)
    y = torch.randint(0, C, (3, 4, 4))
    y[0, 0] = 255  # void pixels are left out
    p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    logits = forward(model, p, {}, x)[1]
    per_image = [nn.functional.cross_entropy(logits[i:i + 1], y[i:i + 1], ignore_index=255)
                 for i in range(3)]
    want = torch.autograd.grad(sum(per_image) / 3, list(p.values()))
    got = gradient_at(model, params, {}, x, y, rows=2)
    for k, w in zip(p, want):
        assert torch.allclose(got[k], w, atol=1e-6), k


@pytest.mark.parametrize("algorithm", NAMES)
def test_runs_end_to_end_on_fashion_mnist_files(tmp_path, algorithm):
    root = tmp_path / "fashion"
    write_fashion(root, n_train=120, n_test=20)
    out = tmp_path / "run"
    assert main(["run", "configs/fashion_mnist.yaml", "--algorithm", algorithm, "--rounds",
                 "2", "-q", "--out", str(out), "--set", f"data.root={root}",
                 "--set", "data.num_clients=4", "--set", "clients.per_round=2",
                 "--set", "clients.local_epochs=1", "--set", "clients.batch_size=16",
                 "--set", "metrics.dissimilarity_clients=0"]) == 0
    spec = json.loads((out / "config.json").read_text())
    assert spec["algorithm"] == algorithm and spec["model"]["name"] == "lenet5"
    assert spec["data"]["root"] == str(root)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
