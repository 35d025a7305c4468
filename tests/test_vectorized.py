"""The vectorized trainer gives the sequential trainer's results; its optimizers match
torch.optim; models it cannot vectorize fall back to the sequential path."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from protofl.algorithms.registry import make_algorithm
from protofl.data.federated import from_client_lists
from protofl.engine import optim, trainers, vectorized
from protofl.engine.federation import info
from protofl.engine.schedule import Job
from protofl.engine.train import LocalSetup, RoundContext, SequentialTrainer
from protofl.engine.vectorized import VectorizedTrainer
from protofl.models.nets import Mlp, ProtoNet
from protofl.nested import flatten

C = 3



def federation(sizes=(13, 3, 9, 22)):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, 5, generator=g) for n in sizes]
    ys = [torch.arange(n) % C for n in sizes]
    return from_client_lists("toy", C, xs, ys, local_test_fraction=0.0)


def assert_same(a: dict, b: dict, tol: float = 1e-9) -> None:
    fa, fb = flatten(a), flatten(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        va, vb = fa[k], fb[k]
        if isinstance(va, torch.Tensor):
            assert va.shape == vb.shape, k
            if va.is_floating_point():
                assert torch.allclose(va, vb, atol=tol, rtol=0, equal_nan=True), (
                    k, (va - vb).abs().max())
            else:
                assert torch.equal(va, vb), k
        else:
            assert va == vb, k


def train_sequential(alg, model, glob, jobs, data, client_states, s, rnd):
    assert model is alg.model
    return SequentialTrainer().train(RoundContext(alg, glob, jobs, data, client_states, s, rnd))


def train_vectorized(alg, model, glob, jobs, data, client_states, s, rnd, budget=None,
                     solo_max=0):
    assert model is alg.model
    rc = RoundContext(alg, glob, jobs, data, client_states, s, rnd)
    return VectorizedTrainer(budget, solo_max).train(rc)


def assert_results_equal(seq, vec):
    assert [r.client for r in seq] == [r.client for r in vec]
    for r, v in zip(seq, vec):
        assert_same(r.upload, v.upload)
        assert_same(r.state, v.state)
        assert abs(r.loss - v.loss) < 1e-9


SETUPS = {
    "sgd-momentum-steps": LocalSetup(4, True, "sgd", 0.1, 0.9, 1e-3, seed=1),
    "adam-epochs": LocalSetup(5, False, "adam", 0.01, 0.0, 1e-2, seed=2),
}


def test_chunks_give_the_same_result(float64):
    s = SETUPS["sgd-momentum-steps"]
    data = federation((7, 11, 4, 9, 3))
    model = Mlp(5, C, hidden=(8, 6))
    alg = make_algorithm("fedprox", {"mu": 0.5}, model, C)
    glob = alg.broadcast(alg.init_state(model))
    jobs = [Job(k, a) for k, a in enumerate((4, 2, 4, 1, 3))]
    whole = train_vectorized(alg, model, glob, jobs, data, {}, s, 1)
    assert vectorized.chunk_size(model, glob, data.x_train, 4, 1) == 1
    one_by_one = train_vectorized(alg, model, glob, jobs, data, {}, s, 1, budget=1)
    assert_results_equal(whole, one_by_one)


@pytest.mark.parametrize("masked", [False, True], ids=["prefix", "mask"])
@pytest.mark.parametrize("opt,momentum,wd", [("sgd", 0.0, 0.0), ("sgd", 0.9, 0.01),
                                             ("adam", 0.0, 0.0), ("adam", 0.0, 0.1)])
def test_optimizers_match_torch(float64, opt, momentum, wd, masked):
    """Clients without a step t stay exactly unchanged, whether they are left out of the
    views (prefix) or marked inactive (mask, the compiled step's fixed shape)."""
    s = LocalSetup(1, True, opt, 0.05, momentum, wd)
    g = torch.Generator().manual_seed(3)
    start = {"a": torch.randn(3, 4, 2, generator=g), "b": torch.randn(3, 5, generator=g)}
    steps = [5, 3, 1]  # per client; a client without a step t must stay exactly unchanged
    grads = [[{k: torch.randn(v.shape[1:], generator=g) for k, v in start.items()}
              for _ in range(n)] for n in steps]
    stacked = {k: v.clone() for k, v in start.items()}
    state = optim.init_state(stacked, s)
    for t in range(max(steps)):
        n = sum(1 for m in steps if m > t)
        before = {k: v[n:].clone() for k, v in stacked.items()}
        g_t = {k: torch.stack([grads[i][t][k] for i in range(n)]) for k in stacked}
        if masked:  # every client in the step, those past their last step marked inactive
            g_t = {k: torch.cat([v, torch.randn(3 - n, *v.shape[1:], generator=g)])
                   for k, v in g_t.items()}
            optim.step_(stacked, g_t, state, s, active=torch.arange(3) < n)
        else:
            optim.step_({k: v[:n] for k, v in stacked.items()}, g_t, state.part(slice(n)), s)
        for k in stacked:
            assert torch.equal(stacked[k][n:], before[k])
    assert state.step.tolist() == steps
    assert isinstance(state, optim.AdamState if opt == "adam" else optim.SgdState)
    for i, n in enumerate(steps):
        ref = {k: v[i].clone().requires_grad_(True) for k, v in start.items()}
        if opt == "adam":
            o = torch.optim.Adam(list(ref.values()), lr=s.lr, weight_decay=wd)
        else:
            o = torch.optim.SGD(list(ref.values()), lr=s.lr, momentum=momentum, weight_decay=wd)
        for t in range(n):
            for k, p in ref.items():
                p.grad = grads[i][t][k].clone()
            o.step()
        for k in ref:
            assert torch.allclose(ref[k].detach(), stacked[k][i], atol=1e-12, rtol=0)


class BnNet(ProtoNet):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU())
        self.feature_dim = 6
        self.classifier = nn.Linear(6, C)

    def encode(self, x):
        return self.body(x)


def test_batchnorm_falls_back_and_logs_once(float64, caplog, monkeypatch):
    monkeypatch.setattr(vectorized, "_logged", set())
    data = federation()
    model = BnNet()
    alg = make_algorithm("fedavg", {}, model, C)
    reason = vectorized.vectorize_reason(model)
    assert reason is not None and "BatchNorm1d" in reason
    with caplog.at_level(logging.INFO, logger="protofl"):
        trainer = trainers.make("vectorized", model)
    assert trainer.name == "sequential" and isinstance(trainer, SequentialTrainer)
    assert sum("BatchNorm1d" in r.getMessage() for r in caplog.records) == 1
    caplog.clear()
    s = SETUPS["sgd-momentum-steps"]
    glob = alg.broadcast(alg.init_state(model))
    jobs = [Job(0, 2), Job(3, 2)]
    with caplog.at_level(logging.INFO, logger="protofl"):
        vec = [train_vectorized(alg, model, glob, jobs, data, {}, s, r)
               for r in (1, 1)]
    assert sum("BatchNorm1d" in r.getMessage() for r in caplog.records) == 1
    assert_results_equal(train_sequential(alg, model, glob, jobs, data, {}, s, 1), vec[0])


def test_dropout_model_says_why():
    model = Mlp(5, C, hidden=(8, 6))
    assert vectorized.vectorize_reason(model) is None
    model.body.append(nn.Dropout(0.1))
    assert "Dropout" in vectorized.vectorize_reason(model)


def test_auto_may_pick_vectorized_when_possible():
    model = Mlp(5, C, hidden=(8, 6))
    assert isinstance(trainers.make("auto", model).trainers["vectorized"], VectorizedTrainer)
    assert trainers.make("sequential", model).name == "sequential"


def test_unstackable_context_falls_back(float64, caplog, monkeypatch):
    """A context whose tensors differ in shape between clients cannot be stacked: the round is
    trained sequentially, with the reason logged."""
    from protofl.algorithms.fedavg import FedAvg

    class SizedContext(FedAvg):
        def client_begin(self, c):
            return {"ones": torch.ones(len(c.y))}

    monkeypatch.setattr(vectorized, "_logged", set())
    data = federation()
    model = Mlp(5, C, hidden=(8, 6))
    alg = SizedContext({}, model, C)
    glob = alg.broadcast(alg.init_state(model))
    jobs = [Job(0, 2), Job(1, 2)]
    s = SETUPS["sgd-momentum-steps"]
    with caplog.at_level(logging.INFO, logger="protofl"):
        vec = train_vectorized(alg, model, glob, jobs, data, {}, s, 1)
    assert any("differ in shape" in r.getMessage() for r in caplog.records)
    assert_results_equal(train_sequential(alg, model, glob, jobs, data, {}, s, 1), vec)


def seg_federation(sizes=(5, 2, 4), side=16):
    """Images (floats) with uint8 masks, a void border row on each."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.rand(n, 3, side, side, generator=g) for n in sizes]
    ys = []
    for n in sizes:
        y = torch.randint(0, C, (n, side, side), generator=g).to(torch.uint8)
        y[:, 0] = 255
        ys.append(y)
    return from_client_lists("seg", C, xs, ys, local_test_fraction=0.0)


# the distinct client parts among the segmentation algorithms (fedatt and central train
# their clients as fedavg does)
@pytest.mark.parametrize("name", ["fedavg", "fedprox", "fedmargin"])
def test_segmentation_with_crop_flip_equals_sequential(float64, monkeypatch, name):
    """DeepLab on masks, the data's crop-and-flip composed with the algorithm's pipeline:
    both trainers draw the same crops and give the same results."""
    from protofl.data.seg_augment import crop_flip_transform
    from protofl.models.deeplab import DeepLabV3Plus

    monkeypatch.setattr(vectorized, "SequentialTrainer", None)  # no silent fallback
    data = seg_federation()
    torch.manual_seed(0)
    alg = make_algorithm(name, {}, DeepLabV3Plus((3, 16, 16), C, width=0.25, channels=8), C)
    s = LocalSetup(2, True, "adam", 0.01, 0.0, 1e-3, seed=3, augment=crop_flip_transform())
    state, client_states = alg.init_state(alg.model), {}
    jobs = [Job(0, 3), Job(1, 1, straggler=True), Job(2, 2)]
    for rnd in (1, 2):
        glob = alg.broadcast(state)
        seq = train_sequential(alg, alg.model, glob, jobs, data, client_states, s, rnd)
        vec = train_vectorized(alg, alg.model, glob, jobs, data, client_states, s, rnd)
        assert_results_equal(seq, vec)
        state, _ = alg.aggregate(state, [r.upload for r in seq], rnd)


# the distinct client parts the compiled step must trace: a plain loss (fedavg), a proximal
# term against the broadcast (fedprox, with momentum and weight decay), per-batch statistics
# and a prototype loss under Adam (fedproin)
@pytest.mark.parametrize("name,setup", [("fedavg", "sgd-momentum-steps"),
                                        ("fedprox", "sgd-momentum-steps"),
                                        ("fedproin", "adam-epochs")])
def test_compiled_equals_sequential(float64, caplog, monkeypatch, name, setup):
    """The compiled trainer gives the sequential trainer's results (stack sizes 4, 2 and 1,
    clients past their last step masked, windows of 2 steps, the last one padded), and says
    nothing about falling back."""
    from protofl.engine import costs
    from protofl.engine.compiled import CompiledTrainer

    monkeypatch.setattr(costs, "COMPILED_STEPS", 2)  # small graphs: a quick compile
    monkeypatch.setattr(costs, "LOOPED_STEPS", 2)

    s = SETUPS[setup]
    data = federation()
    torch.manual_seed(0)
    model = Mlp(5, C, hidden=(8, 6))
    alg = make_algorithm(name, {}, model, C, info(data))
    state, client_states = alg.init_state(alg.model), {}
    jobs = [Job(0, 3), Job(1, 3), Job(2, 1, straggler=True), Job(3, 2)]
    trainer = CompiledTrainer()
    with caplog.at_level(logging.INFO, logger="protofl"):
        for rnd in (1, 2):
            glob = alg.broadcast(state)
            rc = RoundContext(alg, glob, jobs, data, client_states, s, rnd)
            seq = SequentialTrainer().train(rc)
            assert_results_equal(seq, trainer.train(rc))
            for r in seq:
                if r.state:
                    client_states[r.client] = r.state
            state, _ = alg.aggregate(state, [r.upload for r in seq], rnd)
    assert not [r for r in caplog.records if "compile" in r.getMessage()]


def test_a_looped_window_gives_the_unrolled_windows_numbers(monkeypatch):
    """On a CPU a window's steps are a loop in the graph (torch's scan); unrolled (as on
    CUDA) they give the same weights, bit for bit (fedprox under Adam: a context, a stack of
    sizes 4, 2 and 1, masked clients, a padded window)."""
    from protofl.engine import compiled, costs

    if compiled._scan is None:
        pytest.skip("this torch has no scan")
    monkeypatch.setattr(costs, "LOOPED_STEPS", 2)
    data = federation()
    torch.manual_seed(0)
    alg = make_algorithm("fedprox", {}, Mlp(5, C, hidden=(8, 6)), C, info(data))
    jobs = [Job(0, 3), Job(1, 3), Job(2, 1, straggler=True), Job(3, 2)]
    rc = RoundContext(alg, alg.broadcast(alg.init_state(alg.model)), jobs, data, {},
                      SETUPS["adam-epochs"], 1)
    looped = compiled.CompiledTrainer().train(rc)
    monkeypatch.setattr(compiled, "_looped", lambda device: False)
    monkeypatch.setattr(costs, "COMPILED_STEPS", 2)
    unrolled = compiled.CompiledTrainer().train(rc)
    for a, b in zip(looped, unrolled):
        assert_same(a.upload, b.upload, tol=0.0)


def test_compiled_falls_back_to_eager_steps_saying_why(caplog, monkeypatch):
    """A step torch.compile cannot compile: one line says why, and the round is trained by
    the eager steps with the sequential results."""
    from protofl.engine import compiled

    def refuse(*a, **k):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(compiled.torch, "compile", refuse)
    monkeypatch.setattr(vectorized, "_logged", set())
    data = federation()
    torch.manual_seed(0)
    model = Mlp(5, C, hidden=(8, 6))
    alg = make_algorithm("fedproin", {}, model, C, info(data))
    jobs = [Job(0, 3), Job(1, 3), Job(2, 1, straggler=True), Job(3, 2)]
    rc = RoundContext(alg, alg.broadcast(alg.init_state(alg.model)), jobs, data, {},
                      SETUPS["adam-epochs"], 1)
    with caplog.at_level(logging.INFO, logger="protofl"):
        got = compiled.CompiledTrainer().train(rc)
    seq = SequentialTrainer().train(rc)
    for r, v in zip(seq, got):
        assert_same(r.upload, v.upload, tol=1e-5)
    said = [r.getMessage() for r in caplog.records if "compile" in r.getMessage()]
    assert said == ["compiled trainer: torch.compile failed (RuntimeError: no compiler "
                    "today); training with eager steps"]
