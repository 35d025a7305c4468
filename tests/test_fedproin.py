"""fedproin: every formula against a small case worked by hand or by plain loops."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.func import grad, vmap

from protofl.algorithms.base import UploadEntry, split_state
from protofl.algorithms.fedproin import (
    FedProIn,
    PrototypeModel,
    glvq_loss,
    hinge_loss,
    influence_aggregate,
    nearest_distances,
    prototype_contrast_margin,
    prototype_distances,
)
from protofl.algorithms.registry import make_algorithm
from protofl.cli import main
from protofl.data.pipeline import class_balanced as balanced_order
from protofl.errors import ProtoflError
from protofl.models.nets import ProtoNet
from protofl.testing import client_round, trained


class Identity(ProtoNet):
    """z = x (d = 2), plus a scalar gain so the encoder has a parameter."""

    def __init__(self, d: int = 2, num_classes: int = 2):
        super().__init__()
        self.feature_dim = d
        self.gain = nn.Parameter(torch.ones(()))
        self.classifier = nn.Linear(d, num_classes)

    def encode(self, x):
        return self.gain * x


def make(num_classes: int = 2, per_class: int = 1, **opts) -> FedProIn:
    torch.manual_seed(0)
    return FedProIn({"prototypes_per_class": per_class, **opts}, Identity(2, num_classes),
                    num_classes)


def with_protos(alg: FedProIn, protos: torch.Tensor) -> tuple[dict, dict]:
    params, buffers = split_state(alg.model)
    params["prototypes"] = protos.clone()
    return params, buffers


def ctx_for(alg, params, buffers, x, y, client_state=None):
    glob = {"params": params, "buffers": buffers}
    return alg.client_begin(client_round(alg, glob, x, y, client_state or {}))


# ---- task loss ----
def test_glvq_value_by_hand():
    alg = make(fdl=False, pcl=False, temperature=0.5)
    params, buffers = with_protos(alg, torch.tensor([[[3.0, 0.0]], [[0.0, 4.0]]]))
    x, y = torch.zeros(1, 2), torch.tensor([0])
    ctx = ctx_for(alg, params, buffers, x, y)
    loss = alg.loss(alg.model, params, buffers, x, y, torch.ones(1), ctx)
    mu = (3.0 - 4.0) / (3.0 + 4.0)
    assert math.isclose(float(loss), 1 / (1 + math.exp(-mu / 0.5)), rel_tol=1e-5)
    ident = make(fdl=False, pcl=False, squash="identity")
    assert math.isclose(float(ident.loss(ident.model, params, buffers, x, y, torch.ones(1),
                                         ctx)), mu, rel_tol=1e-5)


def test_glvq_gradient_pulls_and_pushes():
    z = torch.tensor([[1.0, 1.0]], requires_grad=True)
    protos = torch.tensor([[[3.0, 0.0]], [[0.0, 4.0]]], requires_grad=True)
    d_plus, d_minus = nearest_distances(prototype_distances(z, protos), torch.tensor([0]))
    glvq_loss(d_plus, d_minus, 1.0).sum().backward()
    step_z = -z.grad[0]
    to_own, to_other = protos[0, 0] - z[0], protos[1, 0] - z[0]
    assert float(step_z @ to_own.detach()) > 0  # z moves toward the correct prototype
    assert float(step_z @ to_other.detach()) < 0  # and away from the wrong one
    step_p = -protos.grad
    assert float(step_p[0, 0] @ (z[0] - protos[0, 0]).detach()) > 0  # own prototype comes
    assert float(step_p[1, 0] @ (z[0] - protos[1, 0]).detach()) < 0  # other one leaves


def test_nearest_distances_loops():
    g = torch.Generator().manual_seed(0)
    z, protos = torch.randn(5, 3, generator=g), torch.randn(4, 2, 3, generator=g)
    y = torch.tensor([0, 3, 1, 1, 2])
    d_plus, d_minus = nearest_distances(prototype_distances(z, protos), y)
    for i in range(5):
        own = min(float((z[i] - protos[y[i], m]).norm()) for m in range(2))
        other = min(float((z[i] - protos[c, m]).norm()) for c in range(4) for m in range(2)
                    if c != y[i])
        assert math.isclose(float(d_plus[i]), own, rel_tol=1e-5)
        assert math.isclose(float(d_minus[i]), other, rel_tol=1e-5)


def test_hinge_by_hand():
    d_plus, d_minus = torch.tensor([3.0, 1.0]), torch.tensor([4.0, 5.0])
    assert torch.allclose(hinge_loss(d_plus, d_minus, 2.0), torch.tensor([1.0, 0.0]))
    alg = make(fdl=False, pcl=False, task="hinge", hinge_margin=2.0)
    params, buffers = with_protos(alg, torch.tensor([[[3.0, 0.0]], [[0.0, 4.0]]]))
    x, y = torch.zeros(1, 2), torch.tensor([0])
    loss = alg.loss(alg.model, params, buffers, x, y, torch.ones(1),
                    ctx_for(alg, params, buffers, x, y))
    assert math.isclose(float(loss), 1.0, rel_tol=1e-6)


def test_prediction_is_nearest_prototype():
    alg = make(per_class=2)
    protos = torch.tensor([[[0.0, 0.0], [10.0, 10.0]], [[5.0, 0.0], [0.0, 5.0]]])
    params, buffers = with_protos(alg, protos)
    x = torch.tensor([[9.0, 9.0], [4.0, 1.0], [1.0, 1.0]])
    scores = alg.predict(alg.model, params, buffers, {}, x)
    assert scores.argmax(1).tolist() == [0, 1, 0]
    assert math.isclose(float(scores[1, 1]), -math.sqrt(2.0), rel_tol=1e-5)


# ---- influence and aggregation ----
def test_influence_counts_tiny_set():
    alg = make(per_class=2, influence="final")
    protos = torch.tensor([[[0.0, 0.0], [10.0, 0.0]], [[0.0, 10.0], [10.0, 10.0]]])
    params, buffers = with_protos(alg, protos)
    # nearest prototype over ALL classes, whatever the label: (0,0) x2, (1,1) x1, (0,1) x1
    x = torch.tensor([[1.0, 1.0], [0.0, 2.0], [9.0, 9.0], [9.0, 1.0]])
    y = torch.tensor([0, 1, 0, 0])
    ctx = ctx_for(alg, params, buffers, x, y)
    up, state = alg.client_end(trained(client_round(alg, {"params": params,
                               "buffers": buffers}, x, y), params, buffers, ctx))
    assert up["influence"].tolist() == [[2.0, 1.0], [0.0, 1.0]]
    assert torch.equal(state["prev_prototypes"], protos)


def test_batch_influence_weighted_by_w():
    """loss_and_stats: nearest-prototype hits of the batch, padding rows (w = 0) count 0."""
    alg = make(per_class=2)
    protos = torch.tensor([[[0.0, 0.0], [10.0, 0.0]], [[0.0, 10.0], [10.0, 10.0]]])
    params, buffers = with_protos(alg, protos)
    x = torch.tensor([[1.0, 1.0], [0.0, 2.0], [9.0, 9.0], [9.0, 1.0], [9.0, 1.0]])
    y = torch.tensor([0, 1, 0, 0, 0])
    w = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])  # the last row is padding
    ctx = ctx_for(alg, params, buffers, x, y)
    loss, stats = alg.loss_and_stats(alg.model, params, buffers, x, y, w, ctx)
    assert torch.equal(loss, alg.loss(alg.model, params, buffers, x, y, w, ctx))
    assert stats["influence"].tolist() == [[2.0, 1.0], [0.0, 1.0]]
    assert make(influence="final").loss_and_stats(alg.model, params, buffers, x, y, w,
                                                  ctx)[1] == {}


def _one_client_round(alg, x, y, units, by_steps, batch=4):
    from protofl.data.federated import from_client_lists
    from protofl.engine.schedule import Job
    from protofl.engine.train import LocalSetup, RoundContext, SequentialTrainer

    data = from_client_lists("toy", 2, [x], [y], local_test_fraction=0.0)
    state = alg.init_state(alg.model)
    setup = LocalSetup(batch, by_steps, "sgd", 0.0, seed=3)  # lr 0: the weights stay put
    rc = RoundContext(alg, alg.broadcast(state), [Job(0, units)], data, {}, setup, 1)
    return SequentialTrainer().train(rc)[0].upload["influence"], rc


@pytest.mark.parametrize("by_steps,units", [(False, 3), (True, 7)])
def test_influence_counts_the_last_epoch_as_trained(by_steps, units):
    """Class-balanced epochs draw the minority class as often as the majority: the last
    epoch's counts follow the draws (about 6 and 6), not n_{k,c} (6 and 2), which is what
    counting every sample once with the final weights gives."""
    from protofl.engine.schedule import local_schedule
    from protofl.seeding import ORDER, torch_gen

    x = torch.tensor([[1.0, 0.0]] * 6 + [[0.0, 1.0]] * 2)
    y = torch.tensor([0] * 6 + [1] * 2)
    alg = make(per_class=1, adaptive_augment=False, fdl=False, pcl=False)
    alg.model.prototypes.data = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
    got, rc = _one_client_round(alg, x, y, units, by_steps)
    y = rc.data.client_train(0)[1]  # as stored
    batches, last = local_schedule(balanced_order, y, units, 4, by_steps,
                                   torch_gen(3, ORDER, 1, 0))
    drawn = torch.cat(batches[len(batches) - last:])
    assert len(drawn) == 12  # one balanced epoch: max_c n_c * C_local = 6 * 2
    expected = torch.tensor([[float((y[drawn] == 0).sum())], [float((y[drawn] == 1).sum())]])
    assert torch.equal(got, expected)
    final, _ = _one_client_round(make(per_class=1, adaptive_augment=False, fdl=False,
                                      pcl=False, influence="final"), x, y, units, by_steps)
    assert final.tolist() == [[6.0], [2.0]] and not torch.equal(got, final)


def test_influence_last_epoch_needs_the_trainer_counts():
    alg = make(per_class=1)
    params, buffers = split_state(alg.model)
    x, y = torch.zeros(2, 2), torch.tensor([0, 1])
    with pytest.raises(ProtoflError, match="last-epoch counts"):
        c = client_round(alg, {"params": params, "buffers": buffers}, x, y)
        alg.client_end(trained(c, params, buffers, ctx_for(alg, params, buffers, x, y)))


def test_nia_by_hand_keeps_unhit_prototype():
    # K = 2 clients, C = 1 class, M = 2 prototypes, d = 2
    protos = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]], [[[3.0, 0.0], [0.0, 5.0]]]])
    influence = torch.tensor([[[1.0, 0.0]], [[3.0, 0.0]]])
    previous = torch.tensor([[[7.0, 7.0], [8.0, 8.0]]])
    out = influence_aggregate(protos, influence, previous)
    assert torch.allclose(out[0, 0], torch.tensor([(1 * 1 + 3 * 3) / 4.0, 0.0]))
    assert torch.equal(out[0, 1], previous[0, 1])  # nobody hit (0, 1): kept


def test_aggregate_encoder_fedavg_prototypes_nia():
    alg = make(per_class=1)
    state = alg.init_state(alg.model)
    prev = torch.tensor([[[9.0, 9.0]], [[-9.0, -9.0]]])
    state["params"]["prototypes"] = prev.clone()
    ups = []
    for gain, protos, infl, n in [(1.0, [[[1.0, 1.0]], [[2.0, 2.0]]], [[3.0], [0.0]], 1.0),
                                  (4.0, [[[5.0, 5.0]], [[6.0, 6.0]]], [[1.0], [0.0]], 3.0)]:
        params = {k: v.clone() for k, v in state["params"].items()}
        params["backbone.gain"] = torch.tensor(gain)
        params["prototypes"] = torch.tensor(protos)
        ups.append({"params": params, "buffers": {}, "num_samples": torch.tensor(n),
                    "influence": torch.tensor(infl)})
    new, diag = alg.aggregate(state, ups, 1)
    assert math.isclose(float(new["params"]["backbone.gain"]), (1 * 1 + 4 * 3) / 4, rel_tol=1e-6)
    assert torch.allclose(new["params"]["prototypes"][0, 0], torch.tensor([2.0, 2.0]))
    assert torch.equal(new["params"]["prototypes"][1, 0], prev[1, 0])
    assert diag["unused_prototypes"] == 1
    plain = make(per_class=1, nia=False)
    new, _ = plain.aggregate(state, ups, 1)  # without NIA: FedAvg (n_k) on the prototypes too
    assert torch.allclose(new["params"]["prototypes"][1, 0], torch.tensor([5.0, 5.0]))


# ---- regularisers ----
def test_pcl_skipped_without_prev_then_switches_on():
    protos_g = torch.tensor([[[0.0, 0.0]], [[4.0, 0.0]]])
    alg = make(fdl=False, lambda_pc=0.1)
    off = make(fdl=False, pcl=False)
    params_g, buffers = with_protos(alg, protos_g)
    moved = {**params_g, "prototypes": torch.tensor([[[1.0, 0.0]], [[4.0, 2.0]]])}
    x, y = torch.tensor([[0.5, 0.5]]), torch.tensor([0])
    ctx = ctx_for(alg, params_g, buffers, x, y)
    assert float(ctx["has_prev"]) == 0
    base = off.loss(off.model, moved, buffers, x, y, torch.ones(1), ctx)
    assert torch.equal(alg.loss(alg.model, moved, buffers, x, y, torch.ones(1), ctx), base)
    prev = torch.tensor([[[3.0, 0.0]], [[4.0, 1.0]]])
    ctx = ctx_for(alg, params_g, buffers, x, y, {"prev_prototypes": prev})
    assert float(ctx["has_prev"]) == 1
    # by hand: (c=0) a = 1, b = 2 -> max(0, -1/3 + 1/2) = 1/6; (c=1) a = 2, b = 1 -> 1/3 + 1/2
    expected = ((1 / 6) + (1 / 3 + 0.5)) / 2
    pc = prototype_contrast_margin(moved["prototypes"], protos_g, prev, 0.5)
    assert math.isclose(float(pc), expected, rel_tol=1e-5)
    loss = alg.loss(alg.model, moved, buffers, x, y, torch.ones(1), ctx)
    assert math.isclose(float(loss - base), 0.1 * expected, rel_tol=1e-5)
    nce = make(fdl=False, pcl_form="infonce", pcl_temperature=0.5)
    terms = []
    for c in range(2):
        p = moved["prototypes"][c, 0]
        cos_g = 1.0 if c == 1 else 0.0  # (1,0) vs (0,0): zero vector -> cosine 0
        cos_p = float(p @ prev[c, 0] / (p.norm() * prev[c, 0].norm()))
        if c == 1:
            cos_g = float(p @ protos_g[1, 0] / (p.norm() * protos_g[1, 0].norm()))
        e_g, e_p = math.exp(cos_g / 0.5), math.exp(cos_p / 0.5)
        terms.append(-math.log(e_g / (e_g + e_p)))
    loss = nce.loss(nce.model, moved, buffers, x, y, torch.ones(1), ctx)
    assert math.isclose(float(loss - base), 0.1 * sum(terms) / 2, rel_tol=1e-4)


def test_fdl_zero_at_round_start_and_mse_after():
    alg = make(pcl=False, lambda_fd=1.0)
    off = make(pcl=False, fdl=False)
    params, buffers = with_protos(alg, torch.tensor([[[3.0, 0.0]], [[0.0, 4.0]]]))
    x, y = torch.tensor([[1.0, 2.0], [3.0, -1.0]]), torch.tensor([0, 1])
    ctx = ctx_for(alg, params, buffers, x, y)
    w = torch.ones(2)
    assert torch.equal(alg.loss(alg.model, params, buffers, x, y, w, ctx),
                       off.loss(off.model, params, buffers, x, y, w, ctx))
    local = {**params, "backbone.gain": torch.tensor(1.5)}
    diff = alg.loss(alg.model, local, buffers, x, y, w, ctx) - off.loss(
        off.model, local, buffers, x, y, w, ctx)
    mse = float(((1.5 * x - x) ** 2).mean())
    assert math.isclose(float(diff), mse, rel_tol=1e-5)


def test_loss_is_vmap_friendly():
    alg = make(per_class=2)
    params, buffers = with_protos(alg, torch.randn(2, 2, 2, generator=torch.Generator()
                                                   .manual_seed(1)))
    xs = torch.randn(2, 3, 2, generator=torch.Generator().manual_seed(2))
    ys = torch.tensor([[0, 1, 1], [1, 0, 0]])
    ctxs = [ctx_for(alg, params, buffers, xs[i], ys[i], {"prev_prototypes": params[
        "prototypes"] + i}) for i in range(2)]
    ctxs[1]["has_prev"] = torch.tensor(0.0)
    stack = lambda trees: {k: (stack([t[k] for t in trees]) if isinstance(trees[0][k], dict)  # noqa: E731
                               else torch.stack([t[k] for t in trees])) for k in trees[0]}
    local = {**params, "backbone.gain": torch.tensor(1.3)}
    p2 = stack([local, local])

    def f(p, x, y, c):
        return alg.loss(alg.model, p, buffers, x, y, torch.ones(3), c)

    batched = vmap(f)(p2, xs, ys, stack(ctxs))
    loop = torch.stack([f(local, xs[i], ys[i], ctxs[i]) for i in range(2)])
    assert torch.allclose(batched, loop, atol=1e-6)
    g = vmap(grad(f))(p2, xs, ys, stack(ctxs))
    assert all(torch.isfinite(v).all() for v in g.values())


# ---- sampling and options ----
def test_balanced_sampling_frequencies():
    y = torch.tensor([0] * 6 + [1] * 2 + [3] * 1)  # C_local = 3, n = 6, 2, 1
    gen = torch.Generator().manual_seed(0)
    draws = torch.cat([balanced_order(y, gen) for _ in range(2000)])
    assert len(balanced_order(y, gen)) == 6 * 3
    freq = torch.bincount(draws, minlength=len(y)).double() / len(draws)
    expected = torch.tensor([1 / (3 * 6)] * 6 + [1 / (3 * 2)] * 2 + [1 / 3], dtype=freq.dtype)
    assert torch.allclose(freq, expected, atol=0.01)


def test_options_validated():
    for bad in [{"prototypes_per_class": 0}, {"task": "ce"}, {"temperature": 0.0},
                {"lambda_fd": -1.0}, {"pcl_form": "cosine"}, {"typo": 1}]:
        with pytest.raises(ProtoflError):
            make_algorithm("fedproin", bad, Identity(), 2)


def test_wrap_model_is_idempotent_and_state_has_prototypes():
    alg = make(num_classes=3, per_class=3)
    assert isinstance(alg.model, PrototypeModel)
    assert alg.wrap_model(alg.model.backbone) is alg.model
    state = alg.init_state(alg.model)
    assert state["params"]["prototypes"].shape == (3, 3, 2)
    assert alg.upload_spec()["influence"] == UploadEntry((3, 3), count=True, kind="counts")


# ---- whole runs ----
@pytest.mark.parametrize("per_class", [1, 3])
def test_end_to_end_digits(tmp_path, per_class):
    out = tmp_path / "run"
    code = main(["run", "--algorithm", "fedproin", "--dataset", "digits", "--rounds", "2",
                 "--out", str(out), "--set", "data.num_clients=4",
                 "--set", "clients.per_round=2", "--set", "clients.local_steps=1",
                 "--set", "clients.batch_size=16", "--set", "clients.optimizer=adam",
                 "--set", "clients.lr=0.001", "--set", "trainer=sequential",
                 "--set", "metrics.dissimilarity_clients=0",
                 "--set", "metrics.train_loss_samples=200",
                 "--set", f"algo.prototypes_per_class={per_class}"])
    assert code == 0
    lines = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in lines] == [1, 2]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in lines)
    assert "unused_prototypes" in lines[-1]
    assert json.loads((out / "summary.json").read_text())["algorithm"] == "fedproin"


def test_pipeline_augments_by_client_class_counts():
    alg = make(num_classes=2)
    x = torch.rand(400, 1, 6, 6, generator=torch.Generator().manual_seed(0)) + 0.5
    y = torch.tensor([0, 1] * 200)
    counts = torch.tensor([30, 10])  # p = 0 for class 0, 2/3 for class 1
    out, same = alg.pipeline.transform(x, y, torch.Generator().manual_seed(1), counts)
    assert same is y
    changed = (out - x).flatten(1).abs().amax(1) > 1e-6
    assert not changed[y == 0].any()
    assert abs(float(changed[y == 1].float().mean()) - 2 / 3) < 0.08
    off = make(num_classes=2, adaptive_augment=False)
    assert off.pipeline.transform is None
    order = alg.pipeline.order(torch.tensor([0, 0, 0, 1]), torch.Generator().manual_seed(0))
    assert len(order) == 3 * 2  # class-balanced epoch: max_c n_c * C_local draws
