"""HtFLlib's heterogeneous-model methods and FPL (fd, lgfedavg, fedgh, fpl, fml): each server rule
and client loss on a tiny case worked by hand, then 2-round runs on heterogeneous CNNs."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from protofl.algorithms.base import split_state, validate_upload
from protofl.algorithms.capabilities import personalized
from protofl.algorithms.registry import make_algorithm
from protofl.config import config_from_dict
from protofl.engine.experiment import Experiment
from protofl.errors import ProtoflError
from protofl.models.nets import Mlp
from protofl.testing import client_round, trained

METHODS = ("fd", "lgfedavg", "fedgh", "fpl", "fml")
FAST = {"fedgh": {"server_epochs": 3}}


def tiny(name: str, options: dict | None = None, hidden=(2,)):
    """An Mlp 2 -> hidden -> 3 (hidden=(): z = x) and the algorithm on it."""
    torch.manual_seed(0)
    model = Mlp(2, 3, hidden=hidden)
    return make_algorithm(name, options or {}, model, 3), model


# ---- fd ----

def test_fd_server_averages_class_logits_over_holders():
    alg, model = tiny("fd")
    state = alg.init_state(model)
    state["logits"][2] = torch.tensor([7.0, 7.0, 7.0])
    state["present"][2] = 1.0
    a = {"logits": torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [0.0, 0.0, 0.0]]),
         "counts": torch.tensor([2.0, 1.0, 0.0]), "num_samples": torch.tensor(3.0)}
    b = {"logits": torch.tensor([[3.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]),
         "counts": torch.tensor([5.0, 0.0, 0.0]), "num_samples": torch.tensor(5.0)}
    new, _ = alg.aggregate(state, [a, b], 1)
    # class 0: (1+3)/2, (2+0)/2, (3+1)/2 (one vote per client, not per sample); class 1: its
    # only holder's; class 2: nobody holds it, kept
    assert new["logits"].tolist() == [[2.0, 1.0, 2.0], [4.0, 5.0, 6.0], [7.0, 7.0, 7.0]]
    assert new["present"].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("distill", ["mse", "soft_ce"])
def test_fd_loss_is_ce_plus_lambda_distillation(distill):
    alg, model = tiny("fd", {"lam": 0.5, "distill": distill})
    x = torch.tensor([[0.5, -1.0], [1.0, 2.0], [-1.0, 0.3], [0.2, 0.2]])
    y = torch.tensor([0, 1, 2, 1])
    w = torch.tensor([1.0, 1.0, 1.0, 0.0])
    target = torch.tensor([[0.2, 0.5, 0.3], [1.0, -1.0, 0.0], [9.0, 9.0, 9.0]])
    ctx = {"logits": target, "present": torch.tensor([1.0, 1.0, 0.0])}
    with torch.no_grad():
        logits = model(x)[1]
    total = 0.0
    for i in range(3):  # row 3 is padding
        row, c = logits[i].tolist(), int(y[i])
        log_p = [v - math.log(sum(math.exp(u) for u in row)) for v in row]
        term = 0.0
        if c != 2:  # class 2 has no global logit
            t = target[c].tolist()
            term = (sum((a - b) ** 2 for a, b in zip(row, t)) / 3 if distill == "mse"
                    else -sum(ti * lp for ti, lp in zip(t, log_p)))
        total += -log_p[c] + 0.5 * term
    params, buffers = split_state(model)
    assert float(alg.loss(model, params, buffers, x, y, w, ctx)) == pytest.approx(total / 3,
                                                                                 rel=1e-6)


def test_fd_uploads_class_mean_logits_of_the_pass_or_of_the_trained_model():
    alg, model = tiny("fd")
    params, buffers = split_state(model)
    x, y = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]]), torch.tensor([0, 0, 2])
    stats = {"proto_sums": torch.tensor([[2.0, 4.0, 6.0], [0.0] * 3, [1.0, 1.0, 1.0]]),
             "proto_counts": torch.tensor([2.0, 0.0, 1.0])}
    c = client_round(alg, {}, x, y, model=model)
    up, own = alg.client_end(trained(c, params, buffers, {}, stats))
    validate_upload(up, alg.upload_spec())
    assert up["logits"].tolist() == [[1.0, 2.0, 3.0], [0.0] * 3, [1.0, 1.0, 1.0]]
    assert up["counts"].tolist() == [2.0, 0.0, 1.0] and "params" not in up
    assert own["params"] is params
    with pytest.raises(ProtoflError, match="logit_pass: training needs"):
        alg.client_end(trained(client_round(alg, {}, x, y, model=model), params, buffers))
    after, _ = tiny("fd", {"logit_pass": "after"})
    up, _ = after.client_end(trained(client_round(after, {}, x, y, model=model), params, buffers))
    with torch.no_grad():
        logits = model(x)[1]
    torch.testing.assert_close(up["logits"][0], (logits[0] + logits[1]) / 2)
    torch.testing.assert_close(up["logits"][2], logits[2])


# ---- lgfedavg ----

def test_lgfedavg_averages_heads_by_sample_count():
    alg, model = tiny("lgfedavg")
    state = alg.init_state(model)
    assert sorted(state["head"]) == ["classifier.bias", "classifier.weight"]
    ones = {k: torch.ones_like(v) for k, v in state["head"].items()}
    fives = {k: 5 * torch.ones_like(v) for k, v in state["head"].items()}
    ups = [{"head": ones, "num_samples": torch.tensor(1.0, dtype=torch.float64)},
           {"head": fives, "num_samples": torch.tensor(3.0, dtype=torch.float64)}]
    new, diag = alg.aggregate(state, ups, 1)
    assert diag["weights"] == [0.25, 0.75]
    for v in new["head"].values():  # (1 * 1 + 3 * 5) / 4
        assert torch.all(v == 4.0)
    assert new["init"] is state["init"] and "params" not in new


def test_lgfedavg_trains_its_own_body_with_the_global_head():
    alg, model = tiny("lgfedavg")
    state = alg.init_state(model)
    state["head"] = {k: torch.full_like(v, 0.5) for k, v in state["head"].items()}
    own = {k: v + 1.0 for k, v in split_state(model)[0].items()}
    start = alg.local_start(alg.broadcast(state), {"params": own, "buffers": {}})
    for k, v in start["params"].items():  # body: the client's own; head: the global one
        assert torch.equal(v, torch.full_like(v, 0.5) if k.startswith("classifier.") else own[k])
    assert alg.eval_weights(state, {"params": own, "buffers": {}})["params"] == start["params"]
    # the client loss is cross-entropy of that model: by hand, z = relu(W1 x + b1), logits all
    # 0.5 * (z1 + z2) + 0.5: every class equally likely
    x, y, w = torch.tensor([[1.0, 2.0]]), torch.tensor([1]), torch.ones(1)
    loss = alg.loss(model, start["params"], {}, x, y, w, {})
    assert float(loss) == pytest.approx(math.log(3), rel=1e-6)
    up, st = alg.client_end(trained(client_round(alg, {}, x, y, model=model), start["params"], {}))
    validate_upload(up, alg.upload_spec())
    assert sorted(up["head"]) == ["classifier.bias", "classifier.weight"]
    assert st["params"] is start["params"]


def test_a_model_without_a_classifier_head_is_one_line():
    from protofl.models.nets import ProtoNet

    class Headless(ProtoNet):
        feature_dim = 2

        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(2, 2)

        def encode(self, x):
            return self.body(x)

        def head(self, z):
            return z

    with pytest.raises(ProtoflError, match="lacks") as e:
        make_algorithm("lgfedavg", {}, Headless(), 2).init_state(Headless())
    assert "\n" not in str(e.value)


# ---- fedgh ----

def test_fedgh_server_trains_the_head_on_uploaded_prototypes_by_hand():
    alg, model = tiny("fedgh", {"server_epochs": 1, "server_batch": 8, "server_lr": 0.5},
                      hidden=())
    state = alg.init_state(model)
    W = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    b = torch.tensor([0.0, 0.0, 1.0])
    state["head"] = {"classifier.weight": W, "classifier.bias": b}
    a = {"protos": torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 2.0]]),
         "counts": torch.tensor([4.0, 0.0, 1.0]), "num_samples": torch.tensor(5.0)}
    c = {"protos": torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]),
         "counts": torch.tensor([0.0, 2.0, 0.0]), "num_samples": torch.tensor(2.0)}
    new, diag = alg.aggregate(state, [a, c], 1)
    # the pairs (p, y): ([1,0], 0), ([0,2], 2), ([1,1], 1); one batch of all three, one step
    pairs = [([1.0, 0.0], 0), ([0.0, 2.0], 2), ([1.0, 1.0], 1)]
    gW = [[0.0, 0.0] for _ in range(3)]
    gb = [0.0] * 3
    loss = 0.0
    for p, y in pairs:
        s = [sum(W[j, i].item() * p[i] for i in range(2)) + b[j].item() for j in range(3)]
        e = [math.exp(v) for v in s]
        prob = [v / sum(e) for v in e]
        loss -= math.log(prob[y]) / 3
        for j in range(3):
            g = (prob[j] - (j == y)) / 3  # d CE / d logit_j, averaged over the batch
            gb[j] += g
            for i in range(2):
                gW[j][i] += g * p[i]
    expect_W = [[W[j, i].item() - 0.5 * gW[j][i] for i in range(2)] for j in range(3)]
    torch.testing.assert_close(new["head"]["classifier.weight"], torch.tensor(expect_W))
    torch.testing.assert_close(new["head"]["classifier.bias"],
                               torch.tensor([b[j].item() - 0.5 * gb[j] for j in range(3)]))
    assert diag["server_loss"][0] == pytest.approx(loss, rel=1e-6)
    assert diag["classes"] == [1, 1, 1]


def test_fedgh_client_uploads_class_means_and_trains_with_cross_entropy():
    alg, model = tiny("fedgh", hidden=())  # z = x: the prototypes are the data's class means
    state = alg.init_state(model)
    start = alg.local_start(alg.broadcast(state), {})
    x = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0]])
    y = torch.tensor([0, 0, 2])
    up, own = alg.client_end(trained(client_round(alg, {}, x, y, model=model), start["params"], {}))
    validate_upload(up, alg.upload_spec())
    assert up["protos"].tolist() == [[2.0, 0.0], [0.0, 0.0], [0.0, 2.0]]
    assert up["counts"].tolist() == [2.0, 0.0, 1.0]
    logits = x @ start["params"]["classifier.weight"].T + start["params"]["classifier.bias"]
    ce = sum(float(torch.logsumexp(logits[i], 0) - logits[i, y[i]]) for i in range(3)) / 3
    got = alg.loss(model, start["params"], {}, x, y, torch.ones(3), {})
    assert float(got) == pytest.approx(ce, rel=1e-6)


def test_fedgh_server_batches_are_seeded_by_the_round():
    alg, model = tiny("fedgh", {"server_epochs": 2, "server_batch": 1})
    state = alg.init_state(model)
    up = {"protos": torch.randn(3, 2, generator=torch.Generator().manual_seed(1)),
          "counts": torch.ones(3), "num_samples": torch.tensor(3.0)}
    one, _ = alg.aggregate(state, [up, up], 1)
    again, _ = alg.aggregate(state, [up, up], 1)
    other, _ = alg.aggregate(state, [up, up], 2)
    w = "classifier.weight"
    assert torch.equal(one["head"][w], again["head"][w])
    assert not torch.equal(one["head"][w], other["head"][w])


# ---- fpl ----

def test_fpl_server_clusters_each_class_and_keeps_absent_ones():
    alg, model = tiny("fpl", {"max_clusters": 3}, hidden=())
    state = alg.init_state(model)
    state["cluster_protos"][2, 0] = torch.tensor([5.0, 5.0])
    state["cluster_mask"][2, 0] = 1.0

    def up(c0, c1):
        return {"protos": torch.tensor([c0, c1, [0.0, 0.0]]),
                "counts": torch.tensor([1.0, 1.0 if c1 != [0.0, 0.0] else 0.0, 0.0]),
                "params": split_state(model)[0], "buffers": {},
                "num_samples": torch.tensor(1.0, dtype=torch.float64)}

    # class 0: [1,0] and [2,0.1] point one way, [0,1] and [0.1,2] the other (cosine): the
    # two first-neighbour pairs are the clusters, the next FINCH step would merge all (one
    # cluster, dropped) -> two cluster prototypes; class 1 from one client: its prototype
    ups = [up([1.0, 0.0], [3.0, 4.0]), up([2.0, 0.1], [0.0, 0.0]), up([0.0, 1.0], [0.0, 0.0]),
           up([0.1, 2.0], [0.0, 0.0])]
    new, diag = alg.aggregate(state, ups, 1)
    got = {tuple(round(v, 4) for v in r) for r, m in zip(new["cluster_protos"][0].tolist(),
                                                          new["cluster_mask"][0]) if m}
    assert got == {(1.5, 0.05), (0.05, 1.5)}
    assert new["cluster_protos"][1].tolist()[0] == [3.0, 4.0]
    assert new["cluster_mask"].tolist() == [[1, 1, 0], [1, 0, 0], [1, 0, 0]]
    assert new["cluster_protos"][2, 0].tolist() == [5.0, 5.0]  # nobody uploaded class 2
    assert diag["cluster_prototypes"] == [2.0, 1.0, 1.0] and diag["weights"] == [0.25] * 4
    # the unbiased prototype is the plain mean of the cluster prototypes
    ctx = alg.client_begin(client_round(alg, alg.broadcast(new), None, None, model=model))
    torch.testing.assert_close(ctx["unbiased"][0], torch.tensor([0.775, 0.775]))


def test_fpl_loss_is_ce_plus_cluster_infonce_plus_mse_to_the_unbiased_prototype():
    alg, model = tiny("fpl", {"max_clusters": 2, "tau": 0.5, "lam_cpcl": 2.0,
                              "lam_upcr": 3.0}, hidden=())
    protos = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[-1.0, 0.0], [0.0, 0.0]],
                           [[0.0, 0.0], [0.0, 0.0]]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    state = {"cluster_protos": protos, "cluster_mask": mask, **alg.init_state(model)}
    state["cluster_protos"], state["cluster_mask"] = protos, mask
    ctx = alg.client_begin(client_round(alg, alg.broadcast(state), None, None, model=model))
    params, buffers = split_state(model)
    x = torch.tensor([[2.0, 1.0], [1.0, -1.0], [0.5, 0.5]])
    y = torch.tensor([0, 1, 2])
    w = torch.ones(3)
    logits = x @ params["classifier.weight"].T + params["classifier.bias"]
    unbiased = {0: [0.5, 0.5], 1: [-1.0, 0.0]}
    real = [(0, [1.0, 0.0]), (0, [0.0, 1.0]), (1, [-1.0, 0.0])]  # (class, prototype)
    total = 0.0
    for i in range(3):
        z, c = x[i].tolist(), int(y[i])
        total += float(torch.logsumexp(logits[i], 0) - logits[i, c])
        if c == 2:  # no global prototype: CE only
            continue
        cos = [sum(a * b for a, b in zip(z, q)) / math.hypot(*z) / math.hypot(*q)
               for _, q in real]
        e = [math.exp(v / 0.5) for v in cos]
        nce = -math.log(sum(v for v, (k, _) in zip(e, real) if k == c) / sum(e))
        mse = sum((a - b) ** 2 for a, b in zip(z, unbiased[c])) / 2
        total += 2.0 * nce + 3.0 * mse
    got = alg.loss(model, params, buffers, x, y, w, ctx)
    assert float(got) == pytest.approx(total / 3, rel=1e-6)


def test_fpl_uploads_prototypes_with_its_weights_and_personal_fpl_without():
    from protofl.algorithms.fpl import PersonalFPL

    alg, model = tiny("fpl", hidden=())
    params, buffers = split_state(model)
    x, y = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 0, 2])
    up, _ = alg.client_end(trained(client_round(alg, {}, x, y, model=model), params, buffers))
    validate_upload(up, alg.upload_spec())
    assert up["protos"].tolist() == [[2.0, 0.0], [0.0, 0.0], [0.0, 2.0]] and "params" in up
    personal = PersonalFPL({}, model, 3)
    c = client_round(personal, {}, x, y, model=model)
    up, own = personal.client_end(trained(c, params, buffers))
    validate_upload(up, personal.upload_spec())
    assert "params" not in up and own["params"] is params and personalized(personal)


# ---- fml ----

def fml_case(options):
    alg, _ = tiny("fml", options, hidden=())  # local and meme logits: W x + b
    params = {"backbone.classifier.weight": torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]),
              "backbone.classifier.bias": torch.tensor([0.0, 0.0, 0.5]),
              "meme.classifier.weight": torch.tensor([[0.0, 1.0], [1.0, 1.0], [-1.0, 0.0]]),
              "meme.classifier.bias": torch.tensor([0.2, 0.0, 0.0])}
    params = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    return alg, params


@pytest.mark.parametrize("kl", ["paper", "htfllib"])
def test_fml_loss_is_mutual_learning_by_hand(kl):
    alg, params = fml_case({"alpha": 0.25, "beta": 0.75, "kl": kl})
    x, y, w = torch.tensor([[1.0, 2.0], [-1.0, 0.5]]), torch.tensor([1, 2]), torch.ones(2)
    total = 0.0
    for i in range(2):
        xi = x[i].tolist()

        def logits(prefix, xi=xi):
            W, b = params[f"{prefix}.classifier.weight"], params[f"{prefix}.classifier.bias"]
            return [sum(W[j, k].item() * xi[k] for k in range(2)) + b[j].item()
                    for j in range(3)]

        def probs(v):
            e = [math.exp(u) for u in v]
            return [u / sum(e) for u in e]

        p, q = probs(logits("backbone")), probs(logits("meme"))
        kl_qp = sum(a * math.log(a / b) for a, b in zip(q, p))  # KL(meme || local)
        kl_pq = sum(a * math.log(a / b) for a, b in zip(p, q))
        if kl == "htfllib":
            kl_qp, kl_pq = kl_qp / 3, kl_pq / 3
        c = int(y[i])
        total += 0.25 * -math.log(p[c]) + 0.75 * kl_qp + 0.75 * -math.log(q[c]) + 0.25 * kl_pq
    got = alg.loss(alg.model, params, {}, x, y, w, {}).detach()
    assert float(got) == pytest.approx(total / 2, rel=1e-6)


def test_fml_paper_kl_trains_only_the_model_it_belongs_to():
    x, y, w = torch.tensor([[1.0, 2.0], [-1.0, 0.5]]), torch.tensor([1, 2]), torch.ones(2)
    # alpha 0: the local loss is KL(meme || local) alone, beta 1: the meme loss is CE alone
    grads = {}
    for kl in ("paper", "htfllib"):
        alg, params = fml_case({"alpha": 0.0, "beta": 1.0, "kl": kl})
        loss = alg.loss(alg.model, params, {}, x, y, w, {})
        grads[kl] = torch.autograd.grad(loss, params["meme.classifier.weight"])[0]
    alg, params = fml_case({"alpha": 1.0, "beta": 1.0})  # CE of both only
    ce = alg.loss(alg.model, params, {}, x, y, w, {})  # the meme's gradient: CE(meme)'s
    ce_grad = torch.autograd.grad(ce, params["meme.classifier.weight"])[0]
    torch.testing.assert_close(grads["paper"], ce_grad)  # the KL target is a constant
    assert not torch.allclose(grads["htfllib"], ce_grad)  # HtFLlib: the KL trains it too


def test_fml_shares_only_the_meme_model_averaged_by_sample_count():
    alg, _ = tiny("fml", hidden=())
    state = alg.init_state(alg.model)
    assert sorted(state["meme"]) == sorted(k for k, _ in alg.model.named_parameters()
                                           if k.startswith("meme."))
    ups = [{"meme": {k: torch.full_like(v, float(n)) for k, v in state["meme"].items()},
            "num_samples": torch.tensor(float(n), dtype=torch.float64)} for n in (1, 3)]
    new, _ = alg.aggregate(state, ups, 1)
    for v in new["meme"].values():  # (1 * 1 + 3 * 3) / 4
        assert torch.all(v == 2.5)
    own = {k: v + 1 for k, v in split_state(alg.model)[0].items()}
    start = alg.local_start(alg.broadcast(new), {"params": own, "buffers": {}})
    for k, v in start["params"].items():  # own local model, the global meme model
        assert torch.equal(v, new["meme"][k] if k.startswith("meme.") else own[k])
    x = torch.randn(4, 2)
    local = {k[len("backbone."):]: v for k, v in own.items() if k.startswith("backbone.")}
    with torch.no_grad():  # scored with the local model
        expected = x @ local["classifier.weight"].T + local["classifier.bias"]
        got = alg.predict(alg.model, start["params"], {}, new, x)
    torch.testing.assert_close(got, expected)


# ---- end to end: heterogeneous CNNs, every trainer ----

def hetero(name: str, trainer: str = "sequential", **over):
    raw = {"algorithm": name, "rounds": 2, "checkpoint_every": 0, "seed": 1, "threads": 1,
           "trainer": trainer, "data": {"name": "digits", "num_clients": 4},
           "model": {"per_client": ["cnn1", "cnn2"]},
           "clients": {"per_round": 4, "local_steps": 8, "batch_size": 16},
           "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 0},
           "algo": FAST.get(name, {})}
    if trainer == "parallel":
        raw["workers"] = 2
    raw.update(over)
    return config_from_dict(raw)


def shared_state(name: str, state: dict) -> dict:
    """What the server shares in ``name``'s state (the hand-worked rules' output)."""
    keys = {"fd": ("logits", "present"), "lgfedavg": ("head",), "fedgh": ("head",),
            "fpl": ("cluster_protos", "cluster_mask"), "fml": ("meme",)}[name]
    return {k: state[k] for k in keys}


@pytest.mark.parametrize("name", METHODS)
def test_two_rounds_on_heterogeneous_cnns_on_every_trainer(name):
    from protofl.nested import flatten

    runs = {}
    for trainer in ("sequential", "vectorized", "parallel"):
        exp = Experiment(hetero(name, trainer))
        initial = {k: v.clone() for k, v in flatten(shared_state(name, exp.state)).items()}
        runs[trainer] = exp, exp.run()
    exp, summary = runs["sequential"]
    assert exp.cfg.model.name == "heterogeneous" and personalized(exp.alg)
    # 10 classes (chance 0.1): it learned something in 2 rounds of 8 steps (fedgh 0.18 and
    # fml 0.15, whose two models learn from each other, are the slowest here)
    assert summary["local_accuracy"] > 0.13
    final = flatten(shared_state(name, exp.state))
    assert any(not torch.equal(final[k], initial[k]) for k in final)  # the server's rule ran
    groups = exp.alg.groups
    for k, st in exp.client_states.items():  # each client keeps its own model
        assert {n: v.shape for n, v in st["params"].items()} == {
            n: p.shape for n, p in groups.models[groups.of(k)].named_parameters()}
    for other in ("vectorized", "parallel"):
        got = flatten(shared_state(name, runs[other][0].state))
        for k, v in final.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5)
        assert runs[other][1]["local_accuracy"] == pytest.approx(summary["local_accuracy"],
                                                                 abs=1e-6)


def test_fd_server_state_is_the_mean_of_the_last_rounds_uploads():
    exp = Experiment(hetero("fd"))
    seen: list = []
    rule = exp.alg.aggregate

    def recording(state, uploads, round):
        seen.append((state, uploads))
        return rule(state, uploads, round)

    exp.alg.aggregate = recording
    exp.run()
    before, uploads = seen[-1]
    for c in range(10):
        holders = [u["logits"][c] for u in uploads if u["counts"][c] > 0]
        expected = sum(holders) / len(holders) if holders else before["logits"][c]
        torch.testing.assert_close(exp.state["logits"][c], expected)


# ---- privacy ----

def dp(name: str, **privacy):
    return hetero(name, rounds=1, clients={"per_round": 4, "local_steps": 2, "batch_size": 16,
                                           "sampling": "uniform"},
                  privacy={"noise_multiplier": 0.5, "clip": 1.0, "proto_clip": 5.0, **privacy})


@pytest.mark.parametrize("name", ["fd", "lgfedavg", "fedgh", "fml"])
def test_dp_runs_where_uploads_are_sums(name, caplog):
    with caplog.at_level(logging.WARNING, "protofl"):
        exp = Experiment(dp(name))
        exp.run()
    assert exp.last["epsilon"] > 0
    if name == "fedgh":
        assert "noised mean prototype of each class" in caplog.text


@pytest.mark.parametrize("name, privacy, needle", [
    ("fpl", {}, "clusters every client's prototypes"),
    ("fedgh", {"secagg": True, "noise_multiplier": 0.0}, "trains the global head"),
])
def test_dp_or_secure_sums_refused_in_one_line(name, privacy, needle):
    with pytest.raises(ProtoflError, match=needle) as e:
        Experiment(dp(name, **privacy))
    assert "\n" not in str(e.value)


def test_fpl_with_one_model_averages_weights_as_the_paper():
    raw = hetero("fpl").to_dict()
    raw["model"] = {"name": "mlp"}
    exp = Experiment(config_from_dict(raw))
    exp.run()
    assert not personalized(exp.alg) and "params" in exp.state
    assert exp.state["cluster_mask"].sum() > 0
