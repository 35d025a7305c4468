"""FedGen (algorithms/fedgen.py): the generator's teacher and diversity losses, the generator
itself and the client regulariser against small cases computed independently; a server
round that lowers the generator's loss; privacy; 2-round runs on heterogeneous CNNs on every
trainer and on Flower."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from torch import nn

from protofl.algorithms import fedgen
from protofl.algorithms.base import split_state, validate_upload
from protofl.algorithms.capabilities import personalized, sums_reason
from protofl.algorithms.registry import make_algorithm
from protofl.config import config_from_dict
from protofl.engine.experiment import Experiment
from protofl.errors import ProtoflError
from protofl.models.nets import Mlp
from protofl.nested import flatten
from protofl.testing import client_round, trained

FAST = {"server_steps": 5, "server_batch": 8, "samples_per_class": 3}


def tiny(options: dict | None = None, classes: int = 3):
    """An Mlp 2 -> classes with z = x (no hidden layer) and fedgen on it."""
    torch.manual_seed(0)
    model = Mlp(2, classes, hidden=())
    return make_algorithm("fedgen", options or {}, model, classes), model


def softmax(v: list[float]) -> list[float]:
    e = [math.exp(u - max(v)) for u in v]
    return [u / sum(e) for u in e]


def linear(W: list[list[float]], b: list[float], z: list[float]) -> list[float]:
    return [sum(wi * zi for wi, zi in zip(row, z)) + bj for row, bj in zip(W, b)]


def ce(logits: list[float], y: int) -> float:
    return -math.log(softmax(logits)[y])


# ---- the generator's losses ----

HEADS = [([[1.0, 0.0], [0.0, 1.0]], [0.0, 0.0]),  # client 0: W, b
         ([[0.0, 2.0], [1.0, 0.0]], [0.5, 0.0])]  # client 1
COUNTS = [[3.0, 1.0], [1.0, 3.0]]  # n_k[c]: client 0 holds mostly class 0, client 1 class 1
SIZES = [4.0, 12.0]  # n_k (the samples weighting's; not the counts' sums on purpose)


def two_clients():
    _, model = tiny(classes=2)
    heads = [{"classifier.weight": torch.tensor(W), "classifier.bias": torch.tensor(b)}
             for W, b in HEADS]
    return model, heads


@pytest.mark.parametrize("teacher, how", [("ensemble", "labels"), ("per_client", "labels"),
                                          ("ensemble", "samples")])
def test_teacher_loss_on_two_clients_and_two_classes_by_hand(teacher, how):
    model, heads = two_clients()
    z = [[1.0, 2.0], [-1.0, 0.5], [0.3, -0.2]]
    y = [0, 1, 1]
    weights = fedgen.client_weights(torch.tensor(COUNTS), torch.tensor(SIZES), how)
    total = 0.0
    for zi, c in zip(z, y):
        if how == "labels":  # client k's share of class c: n_k[c] / sum_k n_k[c]
            a = [COUNTS[k][c] / (COUNTS[0][c] + COUNTS[1][c]) for k in range(2)]
        else:
            a = [n / sum(SIZES) for n in SIZES]
        logits = [linear(W, b, zi) for W, b in HEADS]
        if teacher == "ensemble":  # CE of the weighted sum of the two clients' logits
            total += ce([a[0] * u + a[1] * v for u, v in zip(*logits)], c)
        else:  # the weighted sum of each client's CE
            total += a[0] * ce(logits[0], c) + a[1] * ce(logits[1], c)
    got = fedgen.teacher_loss(model, heads, weights, torch.tensor(z), torch.tensor(y), teacher)
    assert float(got) == pytest.approx(total / 3, rel=1e-6)


def test_client_weights_leave_a_class_nobody_holds_at_zero():
    counts = torch.tensor([[2.0, 0.0, 1.0], [6.0, 0.0, 0.0]])
    a = fedgen.client_weights(counts, torch.tensor([3.0, 6.0]), "labels")
    assert a.tolist() == [[0.25, 0.0, 1.0], [0.75, 0.0, 0.0]]
    assert fedgen.label_probs(counts.sum(0), "counts").tolist() == pytest.approx([8 / 9, 0, 1 / 9])
    assert fedgen.label_probs(counts.sum(0), "present").tolist() == [0.5, 0.0, 0.5]
    assert fedgen.label_probs(torch.zeros(3), "counts").tolist() == [0.0] * 3


def test_diversity_loss_by_hand():
    noise = torch.tensor([[0.0], [1.0], [0.5]])
    z = torch.tensor([[0.0, 0.0], [1.0, 3.0], [2.0, 0.0]])
    n, zl = noise.tolist(), z.tolist()
    pairs = 0.0
    for i in range(3):
        for j in range(3):  # mean squared noise difference x mean absolute feature difference
            de = sum((a - b) ** 2 for a, b in zip(n[i], n[j])) / 1
            dz = sum(abs(a - b) for a, b in zip(zl[i], zl[j])) / 2
            pairs += de * dz
    assert float(fedgen.diversity_loss(noise, z)) == pytest.approx(math.exp(-pairs / 9))


def test_generator_is_linear_batchnorm_relu_linear():
    c, noise_dim, hidden, d = 3, 4, 5, 2
    g, running = fedgen.init_generator(noise_dim, c, hidden, d, torch.Generator().manual_seed(0))
    g["gamma"], g["beta"] = torch.rand(hidden) + 0.5, torch.randn(hidden)
    ref = nn.Sequential(nn.Linear(noise_dim + c, hidden, bias=False), nn.BatchNorm1d(hidden),
                        nn.ReLU(),
                        nn.Linear(hidden, d))
    with torch.no_grad():
        for (layer, name), key in zip([(0, "weight"), (1, "weight"), (1, "bias"),
                                       (3, "weight"), (3, "bias")],
                                      ["w1", "gamma", "beta", "w2", "b2"]):
            getattr(ref[layer], name).copy_(g[key])
    noise, labels = torch.rand(6, noise_dim), torch.tensor([0, 2, 1, 1, 0, 2])
    inputs = torch.cat([noise, nn.functional.one_hot(labels, c).float()], 1)
    stats = {k: v.clone() for k, v in running.items()}
    got = fedgen.generate(g, noise, labels, c, stats, train=True)
    ref.train()
    torch.testing.assert_close(got, ref(inputs))  # batch statistics; running ones updated
    torch.testing.assert_close(stats["mean"], ref[1].running_mean)
    torch.testing.assert_close(stats["var"], ref[1].running_var)
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(fedgen.generate(g, noise, labels, c, stats), ref(inputs))


# ---- the client ----

def test_client_loss_is_ce_plus_generated_ce_plus_kl_by_hand():
    alg, model = tiny()
    params, buffers = split_state(model)
    W, b = params["classifier.weight"].tolist(), params["classifier.bias"].tolist()
    bank = torch.tensor([[[1.0, 0.0], [0.5, 0.5]], [[0.0, 1.0], [-1.0, 2.0]],
                         [[2.0, 2.0], [0.0, -1.0]]])  # (C=3, M=2, d=2)
    probs = [0.25, 0.75, 0.0]
    ctx = {"bank": bank, "label_probs": torch.tensor(probs), "alpha": torch.tensor(2.0),
           "beta": torch.tensor(0.5)}
    x = torch.tensor([[0.5, -1.0], [1.0, 2.0], [-1.0, 0.3], [9.0, 9.0]])
    y = torch.tensor([0, 1, 2, 1])
    w = torch.tensor([1.0, 1.0, 1.0, 0.0])  # the last row is padding
    g = bank.tolist()
    rows = 0.0
    for i in range(3):
        logits, c = linear(W, b, x[i].tolist()), int(y[i])
        p = softmax(logits)
        kl = 0.0
        for m in range(2):  # the head's distribution on g[y, m] as the (constant) target
            t = softmax(linear(W, b, g[c][m]))
            kl += sum(ti * math.log(ti / pi) for ti, pi in zip(t, p)) / 2
        rows += ce(logits, c) + 0.5 * kl
    generated = sum(probs[c] * sum(ce(linear(W, b, g[c][m]), c) for m in range(2)) / 2
                    for c in range(3))
    got = alg.loss(model, params, buffers, x, y, w, ctx)
    assert float(got) == pytest.approx(rows / 3 + 2.0 * generated, rel=1e-6)


def test_the_kl_target_is_held_constant():
    alg, model = tiny()
    params = {k: v.requires_grad_(True) for k, v in split_state(model)[0].items()}
    bank = torch.randn(3, 2, 2, generator=torch.Generator().manual_seed(3))
    ctx = {"bank": bank, "label_probs": torch.zeros(3), "alpha": torch.tensor(0.0),
           "beta": torch.tensor(1.0)}
    x, y, w = torch.tensor([[0.5, -1.0], [1.0, 2.0]]), torch.tensor([0, 2]), torch.ones(2)
    got = torch.autograd.grad(alg.loss(model, params, {}, x, y, w, ctx),
                              params["classifier.weight"])[0]
    W, b = params["classifier.weight"], params["classifier.bias"]
    with torch.no_grad():  # the targets, computed apart and fixed
        target = torch.softmax(bank[y] @ W.T + b, -1)  # (2, M, C)
    log_p = torch.log_softmax(x @ W.T + b, -1).unsqueeze(1)
    kl = (target * (target.log() - log_p)).sum(-1).mean(1)
    ce_ = torch.nn.functional.cross_entropy(x @ W.T + b, y, reduction="none")
    want = torch.autograd.grad((ce_ + kl).mean(), W)[0]
    torch.testing.assert_close(got, want)


def test_client_uploads_its_head_and_label_counts():
    alg, model = tiny()
    params, buffers = split_state(model)
    x, y = torch.randn(4, 2), torch.tensor([0, 2, 2, 0])
    up, own = alg.client_end(trained(client_round(alg, {}, x, y, model=model), params, buffers))
    validate_upload(up, alg.upload_spec())
    assert up["counts"].tolist() == [2.0, 0.0, 2.0] and float(up["num_samples"]) == 4.0
    assert sorted(up["head"]) == ["classifier.bias", "classifier.weight"] and "params" not in up
    assert own["params"] is params


# ---- the server ----

def uploads(model, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for counts, n in (([5.0, 1.0, 0.0], 6.0), ([0.0, 2.0, 6.0], 8.0)):
        head = {k: torch.randn(v.shape, generator=gen) for k, v in split_state(model)[0].items()}
        out.append({"head": head, "counts": torch.tensor(counts),
                    "num_samples": torch.tensor(n, dtype=torch.float64)})
    return out


def objective(alg, model, g, running, ups, gen_seed: int = 7) -> float:
    """L_G (teacher + eta diversity) of generator ``g`` on one fixed draw of 600 labels."""
    counts = torch.stack([u["counts"] for u in ups])
    sizes = torch.stack([u["num_samples"] for u in ups])
    probs = fedgen.label_probs(counts.sum(0), alg.opts.labels)
    gen = torch.Generator().manual_seed(gen_seed)
    labels = torch.multinomial(probs.double(), 600, replacement=True, generator=gen)
    noise = torch.rand(600, alg.opts.noise_dim, generator=gen)
    stats = {k: v.clone() for k, v in running.items()}
    with torch.no_grad():
        z = fedgen.generate(g, noise, labels, 3, stats, train=True)
        weights = fedgen.client_weights(counts, sizes, alg.opts.ensemble_weights)
        teacher = fedgen.teacher_loss(model, [u["head"] for u in ups], weights, z, labels,
                                      alg.opts.teacher)
        return float(teacher + alg.opts.eta * fedgen.diversity_loss(noise, z))


def test_a_server_round_lowers_the_generator_loss():
    alg, model = tiny({"server_steps": 40, "server_batch": 16, "server_lr": 0.01})
    state = alg.init_state(model)
    ups = uploads(model)
    new, diag = alg.aggregate(state, ups, 1)
    before = objective(alg, model, state["generator"], state["running"], ups)
    after = objective(alg, model, new["generator"], new["running"], ups)
    assert after < before - 0.1, (before, after)
    assert math.isfinite(diag["server_loss"]) and diag["classes"] == [1, 2, 1]
    # the bank: samples_per_class features of every class from the new generator
    assert new["bank"].shape == (3, 10, 2) and not torch.equal(new["bank"], state["bank"])
    # p(y) from the summed counts; the regulariser switched on at the decayed weights
    torch.testing.assert_close(new["label_probs"], torch.tensor([5.0, 3.0, 6.0]) / 14)
    assert float(state["alpha"]) == 0.0 and float(state["beta"]) == 0.0
    assert float(new["alpha"]) == pytest.approx(10 * 0.98) and float(new["beta"]) == (
        pytest.approx(10 * 0.98))
    # the global head: the n_k-weighted mean of the uploaded heads (lgfedavg's rule)
    for k, v in new["head"].items():
        torch.testing.assert_close(v, (6 * ups[0]["head"][k] + 8 * ups[1]["head"][k]) / 14)
    assert state["generator"]["w1"].requires_grad is False  # the old state is untouched


def test_server_rounds_are_deterministic_per_round():
    alg, model = tiny(FAST)
    state = alg.init_state(model)
    ups = uploads(model)
    one, _ = alg.aggregate(state, ups, 1)
    again, _ = alg.aggregate(copy.deepcopy(state), ups, 1)
    other, _ = alg.aggregate(state, ups, 2)
    for k in ("generator", "running", "bank"):
        for a, b in zip(flatten({k: one[k]}).values(), flatten({k: again[k]}).values()):
            assert torch.equal(a, b)
    assert not torch.equal(one["bank"], other["bank"])
    assert float(other["alpha"]) == pytest.approx(10 * 0.98 ** 2)


def test_schedule_floor_and_off():
    assert fedgen.schedule(10.0, 0.98, 3) == pytest.approx(10 * 0.98 ** 3)
    assert fedgen.schedule(10.0, 0.5, 100) == 1e-4  # the authors' floor
    assert fedgen.schedule(0.0, 0.98, 3) == 0.0  # a switched-off term stays off


def test_nothing_to_generate_keeps_the_generator():
    alg, model = tiny(FAST)
    state = alg.init_state(model)
    ups = uploads(model)
    for u in ups:
        u["counts"] = torch.zeros(3)
    new, _ = alg.aggregate(state, ups, 1)
    assert new["generator"] is state["generator"] and float(new["alpha"]) == 0.0


# ---- privacy ----

def test_sums_only_where_the_teacher_is_the_mean_head():
    assert "own label counts" in sums_reason(tiny()[0])
    assert "alone" in sums_reason(tiny({"teacher": "per_client",
                                        "ensemble_weights": "samples"})[0])
    exact, _ = tiny({"ensemble_weights": "samples"})
    assert sums_reason(exact) == "" and exact.upload_spec()["counts"].kind == "counts"


def hetero(trainer: str = "sequential", **over):
    raw = {"algorithm": "fedgen", "rounds": 2, "checkpoint_every": 0, "seed": 1, "threads": 1,
           "trainer": trainer, "data": {"name": "digits", "num_clients": 4},
           "model": {"per_client": ["cnn1", "cnn2"]},
           "clients": {"per_round": 4, "local_steps": 8, "batch_size": 16},
           "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 0},
           "algo": dict(FAST)}
    if trainer == "parallel":
        raw["workers"] = 2
    raw.update(over)
    return config_from_dict(raw)


def dp(algo: dict | None = None, **privacy):
    return hetero(rounds=1, algo={**FAST, **(algo or {})},
                  clients={"per_round": 4, "local_steps": 2, "batch_size": 16,
                           "sampling": "uniform"},
                  privacy={"noise_multiplier": 0.5, "clip": 1.0, "proto_clip": 5.0, **privacy})


@pytest.mark.parametrize("algo, privacy, needle", [
    ({}, {}, "client-level DP: its server reads 'counts' of each client"),
    ({}, {"secagg": True, "noise_multiplier": 0.0}, "own label counts"),
    ({"teacher": "per_client", "ensemble_weights": "samples"}, {}, "reads 'counts'"),
])
def test_dp_or_secure_sums_refused_in_one_line(algo, privacy, needle):
    with pytest.raises(ProtoflError, match=needle) as e:
        Experiment(dp(algo, **privacy))
    assert "\n" not in str(e.value)


def test_dp_runs_with_the_mean_head_as_teacher(caplog):
    # noise small enough (and seeded) for the noised class counts to pass the DP threshold
    with caplog.at_level(logging.WARNING, "protofl"):
        exp = Experiment(dp({"ensemble_weights": "samples"}, noise_multiplier=0.2,
                            reproducible_noise=True))
        exp.run()
    assert exp.last["epsilon"] > 0 and "fedgen" not in caplog.text  # the exact rule: no fallback
    assert float(exp.state["alpha"]) > 0 and exp.state["label_probs"].sum() == pytest.approx(1)


def test_secure_sums_give_the_exact_rule():
    algo = {**FAST, "ensemble_weights": "samples"}
    plain = Experiment(hetero(rounds=1, algo=algo))
    plain.run()
    secure = Experiment(hetero(rounds=1, algo=algo, privacy={"secagg": True}))
    secure.run()
    for k in ("head", "generator", "bank", "label_probs"):
        a, b = flatten({k: secure.state[k]}), flatten({k: plain.state[k]})
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)


# ---- end to end: heterogeneous CNNs, every trainer ----

SHARED = ("head", "generator", "running", "bank", "label_probs", "alpha", "beta")


def test_two_rounds_on_heterogeneous_cnns_on_every_trainer():
    runs = {}
    for trainer in ("sequential", "vectorized", "parallel"):
        exp = Experiment(hetero(trainer))
        initial = {k: v.clone() for k, v in flatten({k: exp.state[k] for k in SHARED}).items()}
        runs[trainer] = exp, exp.run()
    exp, summary = runs["sequential"]
    assert exp.cfg.model.name == "heterogeneous" and personalized(exp.alg)
    assert summary["local_accuracy"] > 0.13  # 10 classes: it learned something
    final = flatten({k: exp.state[k] for k in SHARED})
    for k in ("head.classifier.weight", "generator.w1", "bank", "alpha"):
        assert not torch.equal(final[k], initial[k])  # the server's rule ran
    groups = exp.alg.groups
    for k, st in exp.client_states.items():  # each client keeps its own model
        assert {n: v.shape for n, v in st["params"].items()} == {
            n: p.shape for n, p in groups.models[groups.of(k)].named_parameters()}
    for other in ("vectorized", "parallel"):
        got = flatten({k: runs[other][0].state[k] for k in SHARED})
        for k, v in final.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5)
        assert runs[other][1]["local_accuracy"] == pytest.approx(summary["local_accuracy"],
                                                                 abs=1e-6)
