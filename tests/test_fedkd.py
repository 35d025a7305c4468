"""FedKD (algorithms/fedkd.py): the adaptive mutual distillation loss and the SVD energy
truncation on small cases worked by hand, the server rule and the client upload, then 2-round
runs on heterogeneous CNNs on every trainer, and under DP and secure sums."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from protofl.algorithms.base import split_state, validate_upload
from protofl.algorithms.capabilities import personalized, sums_reason
from protofl.algorithms.fedkd import energy_rank, mutual_distillation, truncate
from protofl.algorithms.registry import make_algorithm
from protofl.config import config_from_dict
from protofl.engine.experiment import Experiment
from protofl.models.nets import Mlp
from protofl.testing import client_round, trained

R2 = math.sqrt(2.0)


def tiny(options: dict | None = None, classes: int = 3):
    """fedkd on an Mlp 2 -> classes with z = x (so h_t = x and h_s = W_h x)."""
    torch.manual_seed(0)
    return make_algorithm("fedkd", options or {}, Mlp(2, classes, hidden=()), classes)


def softmax(v: list[float]) -> list[float]:
    e = [math.exp(u) for u in v]
    return [u / sum(e) for u in e]


def matvec(m: list[list[float]], v: list[float]) -> list[float]:
    return [sum(a * b for a, b in zip(row, v)) for row in m]


# ---- the adaptive mutual distillation loss ----

PARAMS = {"backbone.classifier.weight": [[1.0, 0.0], [0.0, 1.0], [0.5, -0.5]],
          "backbone.classifier.bias": [0.0, 0.0, 0.5],
          "mentee.classifier.weight": [[0.0, 1.0], [1.0, 1.0], [-1.0, 0.0]],
          "mentee.classifier.bias": [0.2, 0.0, 0.0],
          "project.weight": [[0.5, 0.0], [1.0, -1.0]]}  # W_h


@pytest.mark.parametrize("kl", ["paper", "htfllib"])
def test_loss_is_adaptive_mutual_distillation_by_hand(kl):
    alg = tiny({"kl": kl})
    params = {k: torch.tensor(v, requires_grad=True) for k, v in PARAMS.items()}
    x = torch.tensor([[1.0, 2.0], [-1.0, 0.5], [0.3, 0.3]])
    y, w = torch.tensor([1, 2, 0]), torch.tensor([1.0, 1.0, 0.0])  # row 3 is padding
    ce_t = ce_s = kls = mse = 0.0
    for i in range(2):
        xi, c = x[i].tolist(), int(y[i])

        def logits(prefix, xi=xi):
            return [a + b for a, b in zip(matvec(PARAMS[f"{prefix}.classifier.weight"], xi),
                                          PARAMS[f"{prefix}.classifier.bias"])]

        p, q = softmax(logits("backbone")), softmax(logits("mentee"))  # mentor, mentee
        ce_t -= math.log(p[c]) / 2
        ce_s -= math.log(q[c]) / 2
        kl_qp = sum(a * math.log(a / b) for a, b in zip(q, p))  # KL(mentee || mentor)
        kl_pq = sum(a * math.log(a / b) for a, b in zip(p, q))
        kls += (kl_qp + kl_pq) / (3 if kl == "htfllib" else 1) / 2
        h_s = matvec(PARAMS["project.weight"], xi)  # the mentee's features z = x, projected
        mse += sum((a - b) ** 2 for a, b in zip(xi, h_s)) / 2 / 2
    want = ce_t + ce_s + (kls + 2 * mse) / (ce_t + ce_s)
    got = alg.loss(alg.model, params, {}, x, y, w, {}).detach()
    assert float(got) == pytest.approx(want, rel=1e-6)


@pytest.mark.filterwarnings("ignore:reduction. 'mean' divides")  # HtFLlib's reduction
def test_loss_and_gradients_are_htfllibs_two_losses_summed():
    """HtFLlib's clientkd.py (nn.KLDivLoss(), nn.MSELoss(), nothing detached, both losses
    backpropagated before the steps): the same value and the same gradients in every model."""
    alg = tiny({"kl": "htfllib"})
    params = {k: torch.tensor(v, requires_grad=True) for k, v in PARAMS.items()}
    x = torch.tensor([[1.0, 2.0], [-1.0, 0.5], [0.3, -0.7]])
    y, w = torch.tensor([1, 2, 0]), torch.ones(3)
    mine = alg.loss(alg.model, params, {}, x, y, w, {})
    grads = torch.autograd.grad(mine, list(params.values()))

    ref = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    out = x @ ref["backbone.classifier.weight"].T + ref["backbone.classifier.bias"]
    out_g = x @ ref["mentee.classifier.weight"].T + ref["mentee.classifier.bias"]
    rep, rep_g = x, x @ ref["project.weight"].T
    ce, ce_g = nn.CrossEntropyLoss()(out, y), nn.CrossEntropyLoss()(out_g, y)
    kl, mse = nn.KLDivLoss(reduction="mean"), nn.MSELoss()
    den = ce + ce_g
    loss = ce + kl(F.log_softmax(out, 1), F.softmax(out_g, 1)) / den + mse(rep, rep_g) / den
    loss_g = ce_g + kl(F.log_softmax(out_g, 1), F.softmax(out, 1)) / den + mse(rep, rep_g) / den
    assert float(mine.detach()) == pytest.approx(float((loss + loss_g).detach()), rel=1e-6)
    for g, r in zip(grads, torch.autograd.grad(loss + loss_g, list(ref.values()))):
        torch.testing.assert_close(g, r)
    assert all(bool(g.abs().sum() > 0) for g in grads)  # W_h and both models learn


def test_an_all_padding_batch_costs_nothing():
    logits = torch.randn(2, 3)
    h = torch.randn(2, 4)
    loss = mutual_distillation(logits, logits + 1, h, h * 2, torch.tensor([0, 1]),
                               torch.zeros(2), "paper")
    assert float(loss) == 0.0


# ---- SVD energy truncation ----

def test_energy_truncation_of_a_2x2_matrix_by_hand():
    # A = U diag(2, 1) V^T with U = [[1, 1], [1, -1]] / sqrt 2, V = I: energies 4/5 and 1
    a = torch.tensor([[2.0, 1.0], [2.0, -1.0]]) / R2
    top, floats = truncate(a, 0.75)  # 4/5 >= 0.75: the largest singular value alone
    torch.testing.assert_close(top, torch.tensor([[2.0, 0.0], [2.0, 0.0]]) / R2)
    assert floats == 1 * (2 + 2 + 1)  # u, sigma, v of rank 1
    whole, floats = truncate(a, 0.85)  # 4/5 < 0.85: both
    torch.testing.assert_close(whole, a)
    assert floats == 2 * 5


@pytest.mark.parametrize("energy, rank", [(0.6, 1), (0.9, 2), (0.95, 3), (1.0, 3)])
def test_energy_truncation_of_a_3x3_matrix_by_hand(energy, rank):
    # singular values 3, 2, 1 (a signed permutation of diag(3, 2, 1)): the energy kept by the
    # first r is 9/14 = 0.64, 13/14 = 0.93, 1; at 0.95 all three stay (HtFLlib: none would)
    a = torch.tensor([[0.0, 0.0, 1.0], [3.0, 0.0, 0.0], [0.0, -2.0, 0.0]])
    keep = {1: [[0, 0, 0], [3, 0, 0], [0, 0, 0]], 2: [[0, 0, 0], [3, 0, 0], [0, -2, 0]],
            3: a.tolist()}[rank]
    got, floats = truncate(a, energy)
    torch.testing.assert_close(got, torch.tensor(keep, dtype=torch.float32), atol=1e-6,
                               rtol=0)
    assert floats == rank * 7
    assert energy_rank(torch.tensor([3.0, 2.0, 1.0]), energy) == rank


def test_conv_weights_as_one_matrix_or_per_kernel_by_hand():
    # two 2x2 kernels (out 2, in 1): diag(2, 1) and [[1, 0], [0, 0]]
    t = torch.tensor([[[[2.0, 0.0], [0.0, 1.0]]], [[[1.0, 0.0], [0.0, 0.0]]]])
    # kernel (HtFLlib): singular values (2, 1) and (1, 0); the first index holds 4 + 1 of the
    # 6 of energy (0.83 >= 0.8): rank 1 for every kernel
    got, floats = truncate(t, 0.8, "kernel")
    torch.testing.assert_close(got, torch.tensor([[[[2.0, 0.0], [0.0, 0.0]]],
                                                  [[[1.0, 0.0], [0.0, 0.0]]]]))
    assert floats == 2 * 1 * (2 + 2 + 1)
    # matrix: M = [[2, 0, 0, 1], [1, 0, 0, 0]], M M^T = [[5, 2], [2, 1]] with eigenvalues
    # 3 +- 2 sqrt 2 (0.97 of the energy in the first); rank 1 is u u^T M, u ~ (1, sqrt 2 - 1)
    m = [[2.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]]
    u = [1.0, R2 - 1.0]
    n2 = sum(v * v for v in u)
    proj = [[sum(u[i] * u[k] * m[k][j] for k in range(2)) / n2 for j in range(4)]
            for i in range(2)]
    got, floats = truncate(t, 0.8, "matrix")
    torch.testing.assert_close(got.reshape(2, 4), torch.tensor(proj))
    assert floats == 1 * (2 + 4 + 1)


def test_vectors_single_rows_and_zero_matrices_are_sent_whole():
    for t in (torch.randn(5), torch.randn(1, 4), torch.zeros(3, 3), torch.randn(4, 1, 1, 1)):
        got, floats = truncate(t, 0.5)
        assert got is t and floats == t.numel()


def test_energy_grows_linearly_to_t_end():
    alg = tiny({"t_start": 0.9, "t_end": 0.98, "energy_rounds": 4})
    assert [alg.energy(t) for t in (1, 2, 4, 9)] == pytest.approx([0.92, 0.94, 0.98, 0.98])
    default = tiny()
    assert default.energy(1) == pytest.approx(0.95 + 0.03 / 50)
    state = default.init_state(default.model)
    assert float(default.broadcast(state)["energy"]) == pytest.approx(default.energy(1))


# ---- server rule and client upload ----

A = [[2.0, 1.0], [2.0, -1.0]]  # / sqrt 2: singular values 2 and 1


def mentee(weight, bias) -> dict:
    return {"mentee.classifier.weight": torch.tensor(weight) / R2,
            "mentee.classifier.bias": torch.tensor(bias)}


def upload(weight, bias, n) -> dict:
    return {"mentee": mentee(weight, bias), "num_samples": torch.tensor(float(n),
                                                                        dtype=torch.float64)}


@pytest.mark.parametrize("svd", ["update", "weights", "off"])
def test_server_averages_mentees_uniformly_and_truncates_the_mean(svd):
    alg = tiny({"svd": svd, "t_start": 0.75, "t_end": 0.75}, classes=2)
    state = alg.init_state(alg.model)
    assert sorted(state["mentee"]) == ["mentee.classifier.bias", "mentee.classifier.weight"]
    ones = [[R2, R2], [R2, R2]]  # W^t = all ones
    state["mentee"] = mentee(ones, [1.0, 1.0])
    # uploads W^t + 2 A and W^t, sizes 1 and 3: the uniform mean is W^t + A (n_k ignored)
    ups = [upload([[R2 + 2 * a for a in r] for r in A], [3.0, 1.0], 1),
           upload(ones, [1.0, 1.0], 3)]
    new, diag = alg.aggregate(state, ups, 1)
    assert diag["weights"] == [0.5, 0.5] and diag["energy"] == 0.75
    ones_t, a_t = torch.ones(2, 2), torch.tensor(A) / R2
    rank1 = torch.tensor([[2.0, 0.0], [2.0, 0.0]]) / R2  # A at 0.75: its first singular value
    if svd == "update":  # W^t + trunc(A)
        want = ones_t + rank1
    elif svd == "weights":  # trunc(W^t + A), by numpy's SVD (an independent computation)
        import numpy as np

        u, s, vt = np.linalg.svd((ones_t + a_t).double().numpy())
        r = 1 if s[0] ** 2 >= 0.75 * (s ** 2).sum() else 2
        want = torch.tensor((u[:, :r] * s[:r]) @ vt[:r]).float()
    else:
        want = ones_t + a_t
    torch.testing.assert_close(new["mentee"]["mentee.classifier.weight"], want)
    torch.testing.assert_close(new["mentee"]["mentee.classifier.bias"],
                               torch.tensor([2.0, 1.0]))  # vectors: the plain mean
    assert float(new["energy"]) == 0.75 and new["init"] is state["init"]
    # the floats sent down: weight 4 whole, or its rank-r factors r (2 + 2 + 1); bias 2
    if svd == "update":
        assert diag["download_fraction"] == pytest.approx((5 + 2) / 6)
    elif svd == "off":
        assert diag["download_fraction"] == 1.0


def test_samples_weighting_is_by_n_k():
    alg = tiny({"svd": "off", "weighting": "samples"}, classes=2)
    state = alg.init_state(alg.model)
    ups = [upload([[0.0, 0.0], [0.0, 0.0]], [4.0, 0.0], 1),
           upload([[0.0, 0.0], [0.0, 0.0]], [0.0, 8.0], 3)]
    new, diag = alg.aggregate(state, ups, 1)
    assert diag["weights"] == [0.25, 0.75]
    assert new["mentee"]["mentee.classifier.bias"].tolist() == [1.0, 6.0]
    assert alg.client_weight(ups[1], None) == 3 and alg.client_weight_bound() is None
    uniform = tiny(classes=2)
    assert uniform.client_weight(ups[1], None) == 1 and uniform.client_weight_bound() == 1.0


@pytest.mark.parametrize("svd", ["update", "weights", "off"])
def test_client_uploads_its_truncated_mentee_and_keeps_everything(svd):
    alg = tiny({"svd": svd, "t_start": 0.75, "t_end": 0.75}, classes=2)
    state = alg.init_state(alg.model)
    broadcast = alg.broadcast(state)
    base = broadcast["mentee"]["mentee.classifier.weight"]
    params = split_state(alg.model)[0]
    params["mentee.classifier.weight"] = base + torch.tensor(A) / R2  # W_k = W^t + A
    x, y = torch.randn(3, 2), torch.tensor([0, 1, 1])
    up, own = alg.client_end(trained(client_round(alg, broadcast, x, y), params, {}))
    validate_upload(up, alg.upload_spec())
    assert sorted(up) == ["mentee", "num_samples"] and float(up["num_samples"]) == 3
    got = up["mentee"]["mentee.classifier.weight"]
    rank1 = torch.tensor([[2.0, 0.0], [2.0, 0.0]]) / R2
    if svd == "update":
        torch.testing.assert_close(got, base + rank1)
    elif svd == "weights":
        torch.testing.assert_close(got, truncate(params["mentee.classifier.weight"], 0.75)[0])
    else:
        torch.testing.assert_close(got, params["mentee.classifier.weight"])
    torch.testing.assert_close(up["mentee"]["mentee.classifier.bias"],
                               params["mentee.classifier.bias"])
    assert own["params"] is params  # mentor, mentee and W_h stay on the client


def test_a_round_starts_from_the_own_mentor_and_w_h_with_the_global_mentee():
    alg = tiny()
    state = alg.init_state(alg.model)
    state["mentee"] = {k: v + 5 for k, v in state["mentee"].items()}
    own = {k: v + 1 for k, v in split_state(alg.model)[0].items()}
    start = alg.local_start(alg.broadcast(state), {"params": own, "buffers": {}})
    for k, v in start["params"].items():
        assert torch.equal(v, state["mentee"][k] if k.startswith("mentee.") else own[k])
    x = torch.randn(4, 2)
    with torch.no_grad():  # scored with the mentor
        want = x @ own["backbone.classifier.weight"].T + own["backbone.classifier.bias"]
        got = alg.predict(alg.model, start["params"], {}, state, x)
    torch.testing.assert_close(got, want)
    assert personalized(alg) and sums_reason(alg) == ""


# ---- end to end: heterogeneous CNNs, every trainer, DP ----

def hetero(trainer: str = "sequential", algo: dict | None = None, **over):
    raw = {"algorithm": "fedkd", "rounds": 2, "checkpoint_every": 0, "seed": 1, "threads": 1,
           "trainer": trainer, "data": {"name": "digits", "num_clients": 4},
           "model": {"per_client": ["cnn1", "cnn2"]},
           "clients": {"per_round": 4, "local_steps": 8, "batch_size": 16},
           "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 0},
           "algo": algo or {}}
    if trainer == "parallel":
        raw["workers"] = 2
    raw.update(over)
    return config_from_dict(raw)


def test_two_rounds_on_heterogeneous_cnns_on_every_trainer():
    runs = {}
    for trainer in ("sequential", "vectorized", "parallel"):
        exp = Experiment(hetero(trainer))
        initial = {k: v.clone() for k, v in exp.state["mentee"].items()}
        runs[trainer] = exp, exp.run()
    exp, summary = runs["sequential"]
    assert exp.cfg.model.name == "heterogeneous" and personalized(exp.alg)
    assert summary["local_accuracy"] > 0.13  # 10 classes: it learned in 2 rounds of 8 steps
    assert any(not torch.equal(v, initial[k]) for k, v in exp.state["mentee"].items())
    groups = exp.alg.groups
    mentee = {n: p.shape for n, p in groups.models[0].named_parameters()
              if n.startswith("mentee.")}
    for m in groups.models:  # one mentee architecture (the first model's), W_h d_s -> d_t
        assert {n: p.shape for n, p in m.named_parameters() if n.startswith("mentee.")} == mentee
        assert m.project.weight.shape == (m.backbone.feature_dim, m.mentee.feature_dim)
    for k, st in exp.client_states.items():  # each client keeps its own mentor and W_h
        assert {n: v.shape for n, v in st["params"].items()} == {
            n: p.shape for n, p in groups.models[groups.of(k)].named_parameters()}
    for other in ("vectorized", "parallel"):
        for k, v in exp.state["mentee"].items():
            torch.testing.assert_close(runs[other][0].state["mentee"][k], v, rtol=1e-5,
                                       atol=1e-5)
        assert runs[other][1]["local_accuracy"] == pytest.approx(summary["local_accuracy"],
                                                                 abs=1e-6)


def test_one_model_family_runs_too():
    exp = Experiment(hetero(model={"family": "htfe-cnn"}, rounds=1,
                            data={"name": "digits", "num_clients": 4}))
    exp.run()
    assert exp.alg.groups.distinct[0] == "cnn1"  # the mentee: the family's first, smallest
    assert exp.last["energy"] == pytest.approx(exp.alg.energy(1))


@pytest.mark.parametrize("svd", ["update", "weights"])
def test_dp_with_compression_runs_and_accounts(svd, caplog):
    dp = hetero(algo={"svd": svd}, rounds=1,
                clients={"per_round": 4, "local_steps": 2, "batch_size": 16,
                         "sampling": "uniform"},
                privacy={"noise_multiplier": 0.5, "clip": 1.0})
    with caplog.at_level(logging.WARNING, "protofl"):
        exp = Experiment(dp)
        exp.run()
    assert exp.last["epsilon"] > 0


def test_secure_sums_give_the_plain_rule():
    plain = Experiment(hetero(rounds=1))
    plain.run()
    secure = Experiment(hetero(rounds=1, privacy={"secagg": True}))
    secure.run()
    assert "weights" not in secure.last  # the sums path (its estimate has no client weights)
    for k, v in plain.state["mentee"].items():
        torch.testing.assert_close(secure.state["mentee"][k], v, rtol=1e-4, atol=1e-4)
