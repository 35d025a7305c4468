"""FedMRL (fedmrl): the Matryoshka loss on a tiny case worked by hand, the small model's average
by n_k, what is uploaded and what stays, the fused model a client is scored with; then 2-round
runs on heterogeneous models on every trainer, under DP, and on Flower's simulation."""

from __future__ import annotations

import math

import pytest
import torch

from protofl.algorithms.base import split_state, validate_upload
from protofl.algorithms.capabilities import personalized, sums
from protofl.algorithms.registry import make_algorithm
from protofl.config import config_from_dict
from protofl.engine.experiment import Experiment
from protofl.errors import ProtoflError
from protofl.models.nets import Mlp
from protofl.nested import flatten
from protofl.testing import client_round, trained


def tiny(options: dict | None = None, hidden=()):
    """fedmrl on an Mlp 2 -> hidden -> 3 (hidden=(): the features are x, d2 = 2)."""
    torch.manual_seed(0)
    return make_algorithm("fedmrl", {"sub_dim": 1, **(options or {})},
                          Mlp(2, 3, hidden=hidden), 3)


# hand-set weights of the tiny model: d1 = 1 (the small extractor is the mean of x, pooled
# from its features x), d2 = 2
P = [[1.0, 0.5, -1.0], [0.0, 2.0, 1.0]]  # projector, R = [mean(x), x1, x2] -> R~ (2)
PB = [0.1, -0.2]
WG, BG = [[1.0], [-1.0], [0.5]], [0.0, 0.3, 0.0]  # global header on R~[:1]
WL, BL = [[1.0, 0.0], [0.0, 1.0], [1.0, -1.0]], [0.0, 0.0, 0.2]  # local header on R~


def hand_params() -> dict:
    return {"proj.weight": torch.tensor(P), "proj.bias": torch.tensor(PB),
            "small.classifier.weight": torch.tensor(WG), "small.classifier.bias": torch.tensor(BG),
            "backbone.classifier.weight": torch.tensor(WL),
            "backbone.classifier.bias": torch.tensor(BL)}


def ce(logits: list[float], y: int) -> float:
    return math.log(sum(math.exp(v) for v in logits)) - logits[y]


def by_hand(x: list[float]) -> tuple[list[float], list[float]]:
    """(fine logits, coarse logits) of one sample, in plain Python."""
    r = [(x[0] + x[1]) / 2, x[0], x[1]]
    fused = [sum(P[i][j] * r[j] for j in range(3)) + PB[i] for i in range(2)]
    coarse = [WG[c][0] * fused[0] + BG[c] for c in range(3)]
    fine = [sum(WL[c][j] * fused[j] for j in range(2)) + BL[c] for c in range(3)]
    return fine, coarse


def test_matryoshka_loss_by_hand():
    alg = tiny({"m_global": 0.5, "m_local": 2.0})
    params = hand_params()
    assert sorted(params) == sorted(k for k, _ in alg.model.named_parameters())
    x = torch.tensor([[1.0, 2.0], [-1.0, 0.5], [0.3, -0.7], [5.0, 5.0]])
    y = torch.tensor([0, 2, 1, 1])
    w = torch.tensor([1.0, 1.0, 1.0, 0.0])  # row 3 is padding
    total = 0.0
    for i in range(3):
        fine, coarse = by_hand(x[i].tolist())
        total += 2.0 * ce(fine, int(y[i])) + 0.5 * ce(coarse, int(y[i]))
    got = alg.loss(alg.model, params, {}, x, y, w, {})
    assert float(got) == pytest.approx(total / 3, rel=1e-6)
    # the client is scored with the fused model's local header (predict: the fine logits)
    with torch.no_grad():
        pred = alg.predict(alg.model, params, {}, {}, x)
    torch.testing.assert_close(pred, torch.tensor([by_hand(r)[0] for r in x.tolist()]))


def test_default_sub_dim_and_a_too_large_one():
    alg = make_algorithm("fedmrl", {}, Mlp(2, 3, hidden=(8,)), 3)
    assert alg.model.sub_dim == 2 and alg.model.feature_dim == 8  # d2 // 4
    assert alg.model.proj.in_features == 10 and alg.model.proj.out_features == 8
    with pytest.raises(ProtoflError, match="sub_dim = 9 exceeds .* d2 = 8") as e:
        make_algorithm("fedmrl", {"sub_dim": 9}, Mlp(2, 3, hidden=(8,)), 3)
    assert "\n" not in str(e.value)


def uploads(state: dict, sizes: tuple[float, ...]) -> list[dict]:
    return [{"small": {k: torch.full_like(v, n) for k, v in state["small"].items()},
             "num_samples": torch.tensor(n, dtype=torch.float64)} for n in sizes]


def test_the_small_model_is_averaged_by_sample_count_or_uniformly():
    alg = tiny(hidden=(2,))
    state = alg.init_state(alg.model)
    assert sorted(state["small"]) == sorted(k for k, _ in alg.model.named_parameters()
                                            if k.startswith("small."))
    assert personalized(alg) and sums(alg)
    new, diag = alg.aggregate(state, uploads(state, (1.0, 3.0)), 1)
    assert diag["weights"] == [0.25, 0.75]
    for v in new["small"].values():  # (1 * 1 + 3 * 3) / 4
        assert torch.all(v == 2.5)
    assert new["init"] is state["init"] and "params" not in new
    up = uploads(state, (1.0,))[0]
    assert float(alg.client_weight(up, state)) == 1.0 and alg.client_weight_bound() is None
    uniform = tiny({"aggregation": "uniform"}, hidden=(2,))
    new, diag = uniform.aggregate(state, uploads(state, (1.0, 3.0)), 1)
    assert diag["weights"] == [0.5, 0.5]
    for v in new["small"].values():  # (1 + 3) / 2
        assert torch.all(v == 2.0)
    assert float(uniform.client_weight(uploads(state, (7.0,))[0], state)) == 1.0
    assert uniform.client_weight_bound() == 1.0


def test_only_the_small_model_is_uploaded_and_the_rest_stays():
    alg = tiny(hidden=(2,))
    state = alg.init_state(alg.model)
    state["small"] = {k: torch.full_like(v, 0.5) for k, v in state["small"].items()}
    own = {k: v + 1.0 for k, v in split_state(alg.model)[0].items()}
    start = alg.local_start(alg.broadcast(state), {"params": own, "buffers": {}})
    for k, v in start["params"].items():  # own local model and projector, the global small
        assert torch.equal(v, state["small"][k] if k.startswith("small.") else own[k])
    after = {k: v + 0.25 for k, v in start["params"].items()}
    x, y = torch.tensor([[1.0, 2.0], [0.0, 1.0]]), torch.tensor([0, 2])
    up, kept = alg.client_end(trained(client_round(alg, {}, x, y), after, {}))
    validate_upload(up, alg.upload_spec())
    assert sorted(up) == ["num_samples", "small"] and float(up["num_samples"]) == 2.0
    assert sorted(up["small"]) == sorted(k for k in after if k.startswith("small."))
    assert all(torch.equal(up["small"][k], after[k]) for k in up["small"])
    assert not any(k.startswith(("proj.", "backbone.")) for k in flatten(up)
                   if k != "num_samples")
    assert kept["params"] is after  # local model and projector stay on the client


def test_a_client_is_scored_with_its_own_small_model_or_the_global_one():
    alg = tiny(hidden=(2,))
    state = alg.init_state(alg.model)
    state["small"] = {k: torch.full_like(v, -0.3) for k, v in state["small"].items()}
    own = {k: v + 1.0 for k, v in split_state(alg.model)[0].items()}
    client = {"params": own, "buffers": {}}
    assert alg.eval_weights(state, client)["params"] is own  # the paper's (authors' code)
    scored = tiny({"eval_small": "global"}, hidden=(2,)).eval_weights(state, client)["params"]
    for k, v in scored.items():  # HtFLlib: the latest aggregate small model
        assert torch.equal(v, state["small"][k] if k.startswith("small.") else own[k])
    fresh = alg.eval_weights(state, {})["params"]  # never trained: its first round's start
    for k, v in fresh.items():
        assert torch.equal(v, state["small"][k] if k.startswith("small.")
                           else state["init"]["params"][k])


# ---- end to end: heterogeneous models, every trainer ----

def hetero(trainer: str = "sequential", **over):
    raw = {"algorithm": "fedmrl", "rounds": 2, "checkpoint_every": 0, "seed": 1,
           "threads": 1, "trainer": trainer, "data": {"name": "digits", "num_clients": 4},
           "model": {"per_client": ["cnn1", "cnn2"]},
           "clients": {"per_round": 4, "local_steps": 8, "batch_size": 16},
           "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 0}}
    if trainer == "parallel":
        raw["workers"] = 2
    raw.update(over)
    return config_from_dict(raw)


def test_two_rounds_on_heterogeneous_cnns_on_every_trainer():
    runs = {}
    for trainer in ("sequential", "vectorized", "parallel"):
        exp = Experiment(hetero(trainer))
        initial = {k: v.clone() for k, v in flatten(exp.state["small"]).items()}
        runs[trainer] = exp, exp.run()
    exp, summary = runs["sequential"]
    assert exp.cfg.model.name == "heterogeneous" and personalized(exp.alg)
    assert summary["local_accuracy"] > 0.13  # 10 classes, chance 0.1
    final = flatten(exp.state["small"])
    assert any(not torch.equal(final[k], initial[k]) for k in final)  # the average ran
    groups = exp.alg.groups
    for k, st in exp.client_states.items():  # each client keeps its own fused model
        shapes = {n: p.shape for n, p in groups.models[groups.of(k)].named_parameters()}
        assert {n: v.shape for n, v in st["params"].items()} == shapes
        assert any(n.startswith("proj.") for n in shapes)
    for other in ("vectorized", "parallel"):
        got = flatten(runs[other][0].state["small"])
        for k, v in final.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5)
        assert runs[other][1]["local_accuracy"] == pytest.approx(summary["local_accuracy"],
                                                                 abs=1e-6)


def test_the_server_state_is_the_size_weighted_mean_of_the_last_uploads():
    exp = Experiment(hetero(model={"family": "htfe-cnn"},
                            clients={"per_round": 4, "local_steps": 2, "batch_size": 16}))
    seen: list = []
    rule = exp.alg.aggregate

    def recording(state, ups, round):
        seen.append(ups)
        return rule(state, ups, round)

    exp.alg.aggregate = recording
    exp.run()
    assert len(exp.alg.groups.models) == 4  # every member of the family trained
    ups = seen[-1]
    n = torch.stack([u["num_samples"] for u in ups])
    assert len(set(n.tolist())) > 1  # the weights differ from uniform ones
    for k, v in exp.state["small"].items():
        expected = sum(u["small"][k].double() * nk for u, nk in zip(ups, n)) / n.sum()
        torch.testing.assert_close(v, expected.to(v.dtype))


@pytest.mark.parametrize("privacy", [{"noise_multiplier": 0.5, "clip": 1.0},
                                     {"secagg": True, "noise_multiplier": 0.0}])
def test_dp_and_secure_sums_run_on_the_small_model(privacy):
    clients = {"per_round": 4, "local_steps": 2, "batch_size": 16, "sampling": "uniform"}
    exp = Experiment(hetero(rounds=1, clients=clients, privacy=privacy))
    exp.run()
    if privacy["noise_multiplier"]:
        assert exp.last["epsilon"] > 0
        return
    plain = Experiment(hetero(rounds=1, clients=clients))
    plain.run()  # secure sums without noise: the plain rule's average
    for k, v in flatten(plain.state["small"]).items():
        torch.testing.assert_close(flatten(exp.state["small"])[k], v, rtol=1e-5, atol=1e-6)
