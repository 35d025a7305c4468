"""On a CUDA machine: every algorithm, with both trainers, runs a two-round experiment on the
GPU and on the CPU with the same results up to the devices' arithmetic (weights, final class
scores and losses compared with tolerances: accuracies are counts that one flipped prediction
moves); ``deterministic: true`` repeats a CUDA run bit for bit; prototype sums and feature
passes sized from the free memory give the CPU's values. Marked ``gpu`` and skipped without
CUDA (``pytest -m gpu`` runs only these; benchmarks/gpu.sh runs them)."""

from __future__ import annotations

import math

import pytest
import torch

from protofl import device as devices
from protofl.algorithms import base, prototype_math
from protofl.algorithms.registry import ALGORITHMS
from protofl.config import config_from_dict
from protofl.engine.experiment import Experiment
from protofl.metrics.federated import scores
from protofl.models.registry import build_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA device")]

# fedplvm's default lambda turns rounding differences into visible ones within two rounds
# (see test_vectorized.py); fedtgp's server training is shortened
ALGO = {"fedplvm": {"lam": 1.0}, "fedtgp": {"server_epochs": 5}}
FIGURES = ("loss", "client_loss", "train_loss", "amm")  # continuous: no counts of hits
TOL = {"rtol": 1e-3, "atol": 1e-4}  # float32 rounding after two rounds, TF32 off


@pytest.fixture(autouse=True)
def _restore_settings():
    """Runs here set ``deterministic: true`` (no TF32, deterministic kernels: CPU and GPU then
    differ by rounding only); the process's settings are restored after each test."""
    yield
    devices.set_deterministic(False)


def run(algorithm: str, trainer: str, device: str, precision: str = "fp32",
        deterministic: bool = True) -> Experiment:
    cfg = config_from_dict({
        "algorithm": algorithm, "rounds": 2, "checkpoint_every": 0, "trainer": trainer,
        "device": device, "precision": precision, "deterministic": deterministic,
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
            assert b == pytest.approx(a, rel=TOL["rtol"], abs=TOL["atol"]), key
    for k, v in cpu.state.get("params", {}).items():
        assert torch.allclose(v, gpu.state["params"][k].cpu(), **TOL), k
    theirs = _named_dict(gpu.client_states)  # personalised weights, prototypes
    for name_, v in _named(cpu.client_states):
        assert torch.allclose(v.double(), theirs[name_].double(), **TOL), name_
    a, b = final_scores(cpu), final_scores(gpu)
    assert (a is None) == (b is None)
    if a is not None:
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-3)
    snap = gpu.snapshot()
    assert all(t.device.type == "cpu" for t in _tensors(snap))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_on_cuda(precision):
    fp32 = run("fedavg", "vectorized", "cuda")
    got = run("fedavg", "vectorized", "cuda", precision)
    assert got.summary_["loss"] == pytest.approx(fp32.summary_["loss"], abs=0.05)


def final_scores(exp: Experiment) -> torch.Tensor | None:
    """Class scores of the aggregate model on the first 200 test rows (None: no aggregate)."""
    w = exp.alg.global_weights(exp.state)
    if w is None:
        return None
    return scores(exp.alg, exp.alg.model, w["params"], w["buffers"], exp.state,
                  exp.data.x_test[:200], 64, exp.data.inputs).cpu().double()


def _named(tree, prefix=""):
    """``(path, tensor on the CPU)`` of every floating tensor of a nested dict."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _named(v, f"{prefix}{k}.")
    elif isinstance(tree, torch.Tensor) and tree.is_floating_point():
        yield prefix, tree.cpu()


def _named_dict(tree) -> dict:
    return dict(_named(tree))


def test_deterministic_cuda_runs_repeat_bit_for_bit():
    a, b = (run("fedproto", "vectorized", "cuda") for _ in range(2))
    drop = ("seconds",)
    assert {k: v for k, v in a.summary_.items() if k not in drop} == {
        k: v for k, v in b.summary_.items() if k not in drop}
    for one, two in ((a.state, b.state), (a.client_states, b.client_states)):
        other = _named_dict(two)
        for name_, v in _named(one):
            assert torch.equal(v, other[name_]), name_


def test_prototype_sums_on_cuda_are_repeatable_and_match_the_cpu():
    g = torch.Generator().manual_seed(0)
    z, y = torch.randn(50_000, 64, generator=g), torch.randint(0, 10, (50_000,), generator=g)
    want = prototype_math.class_sums(z.double(), y, 10)[0]
    runs = [prototype_math.class_sums(z.cuda(), y.cuda(), 10)[0] for _ in range(3)]
    assert all(torch.equal(r, runs[0]) for r in runs)
    assert torch.allclose(runs[0].cpu().double(), want, rtol=1e-5, atol=1e-3)


def test_feature_passes_fit_the_free_memory_and_match_the_cpu():
    model = build_model("resnet18", (3, 64, 64), 10).eval()
    params, buffers = base.split_state(model)
    x = torch.rand(300, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    want = base.features(model, params, buffers, x)
    devices.set_deterministic(True)  # no TF32: CUDA's convolutions then round as float32
    model.cuda()
    p, b = devices.to_device(params, "cuda"), devices.to_device(buffers, "cuda")
    rows = devices.forward_rows("cuda", x.cuda(), base.FEATURE_BATCH,
                                lambda v: base.forward(model, p, b, v))
    assert 1 <= rows <= base.FEATURE_BATCH
    got = base.features(model, p, b, x.cuda())
    assert torch.allclose(got.cpu(), want, rtol=1e-3, atol=1e-3)


def untrained_logits(exp: Experiment, x: torch.Tensor) -> torch.Tensor:
    """The aggregate model's logits of ``x`` in eval mode, on the CPU (its state untouched)."""
    w = {k: {n: t.clone() for n, t in v.items()} for k, v in
         exp.alg.global_weights(exp.state).items()}
    model = exp.alg.model
    model.eval()
    with torch.no_grad():
        out = base.forward(model, w["params"], w["buffers"], x.to(exp.device))[1].cpu()
    model.train()
    return out


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
    cpu, gpu = (Experiment(config_from_dict({**raw, "device": d, "deterministic": True}))
                for d in ("cpu", "cuda"))
    # the untrained model's forward pass alone (eval mode, no TF32) agrees to float32 rounding
    devices.set_deterministic(True)
    want, got = (untrained_logits(e, cpu.data.inputs(cpu.data.x_test[:8])) for e in (cpu, gpu))
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    a, b = cpu.run(), gpu.run()
    for key in ("loss", "train_loss", "amm", "dissimilarity"):  # not mIoU: pixel counts
        assert b[key] == pytest.approx(a[key], rel=TOL["rtol"], abs=TOL["atol"]), key
    for k, v in cpu.state.get("params", {}).items():
        assert torch.allclose(v, gpu.state["params"][k].cpu(), **TOL), k

