import numpy as np
import torch

from protofl.algorithms.base import weighted_average
from protofl.algorithms.fedavg import attentive_update, proximal_term
from protofl.algorithms.registry import make_algorithm
from protofl.models.nets import Mlp
from protofl.testing import client_round


def _up(params, n):
    return {"params": params, "buffers": {},
            "num_samples": torch.tensor(float(n), dtype=torch.float64)}


def test_fedavg_weights_by_samples():
    model = Mlp(3, 2, hidden=(2,))
    alg = make_algorithm("fedavg", {}, model, 2)
    state = alg.init_state(model)
    a = {k: torch.ones_like(v) for k, v in state["params"].items()}
    b = {k: 5 * torch.ones_like(v) for k, v in state["params"].items()}
    new, diag = alg.aggregate(state, [_up(a, 30), _up(b, 10)], 1)
    assert diag["weights"] == [0.75, 0.25]
    for v in new["params"].values():
        assert torch.allclose(v, torch.full_like(v, 2.0))  # .75 * 1 + .25 * 5


def test_weighted_average_keeps_integer_buffers():
    t = [{"w": torch.tensor([1.0]), "n": torch.tensor(3)},
         {"w": torch.tensor([3.0]), "n": torch.tensor(7)}]
    out = weighted_average(t, torch.tensor([0.5, 0.5]))
    assert out["w"].item() == 2.0 and out["n"].item() == 3


def test_proximal_term_and_its_gradient():
    w = {"a": torch.tensor([1.0, 2.0], requires_grad=True)}
    anchor = {"a": torch.tensor([0.0, 4.0])}
    term = proximal_term(w, anchor)
    assert term.item() == 5.0  # 1 + 4
    (0.5 * 0.1 * term).backward()
    assert torch.allclose(w["a"].grad, 0.1 * torch.tensor([1.0, -2.0]))  # mu (W - W^t)


def test_fedprox_loss_adds_the_term():
    torch.manual_seed(0)
    model = Mlp(3, 2, hidden=(4,))
    prox = make_algorithm("fedprox", {"mu": 0.5}, model, 2)
    avg = make_algorithm("fedavg", {}, model, 2)
    state = prox.init_state(model)
    moved = {k: v + 0.1 for k, v in state["params"].items()}
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 0, 1, 1])
    w = torch.ones(5)
    ctx = prox.client_begin(client_round(prox, prox.broadcast(state), x, y, model=model))
    diff = prox.loss(model, moved, {}, x, y, w, ctx) - avg.loss(model, moved, {}, x, y, w, {})
    n = sum(v.numel() for v in moved.values())
    assert abs(diff.item() - 0.25 * n * 0.01) < 1e-5


def test_fedatt_against_numpy():
    rng = np.random.default_rng(0)
    g = {"w": rng.normal(size=(2, 3)), "b": rng.normal(size=3)}
    locs = [{k: v + rng.normal(size=v.shape) for k, v in g.items()} for _ in range(3)]
    out, attention = attentive_update({k: torch.tensor(v) for k, v in g.items()},
                                      [{k: torch.tensor(v) for k, v in lo.items()}
                                       for lo in locs], 1.2)
    for i, k in enumerate(g):
        s = np.array([np.linalg.norm((g[k] - lo[k]).ravel()) for lo in locs])
        alpha = np.exp(s) / np.exp(s).sum()
        want = g[k] - 1.2 * sum(a * (g[k] - lo[k]) for a, lo in zip(alpha, locs))
        assert np.allclose(out[k].numpy(), want)
        assert np.allclose(attention[i].numpy(), alpha)  # the weights fedatt reports


def test_fedatt_reports_the_attention_it_used_not_fedavg_weights():
    model = Mlp(3, 2, hidden=(2,))
    alg = make_algorithm("fedatt", {}, model, 2)
    state = alg.init_state(model)
    near = {k: v + 0.01 for k, v in state["params"].items()}
    far = {k: v + 1.0 for k, v in state["params"].items()}
    _, diag = alg.aggregate(state, [_up(near, 90), _up(far, 10)], 1)
    assert abs(sum(diag["weights"]) - 1.0) < 1e-6  # float32 softmax
    assert diag["weights"][1] > diag["weights"][0]  # FedAvg's would be [0.9, 0.1]


def test_step_budget_matches_a_federated_round():
    from protofl.engine.schedule import step_budget

    sizes = np.array([10, 25, 7, 40])
    assert step_budget(sizes, 3, 2, 5, 10) == 15  # K' S
    # E K' mean_k ceil(n_k / B) = 2 * 3 * mean(1, 3, 1, 4) = 13.5 -> 14
    assert step_budget(sizes, 3, 2, None, 10) == 14


def test_central_trains_one_pooled_client_with_the_federated_budget(tiny_digits):
    exp, summary = tiny_digits("central")
    fed, _ = tiny_digits("fedavg")
    assert exp.train_data.num_clients == 1 and exp.data.num_clients == 4
    assert len(exp.train_data.y_train) == len(fed.data.y_train)
    c = exp.cfg.clients
    assert (c.per_round, c.local_steps, c.stragglers) == (1, 2 * 2, 0.0)  # K' S = 2 * 2
    assert summary["algorithm"] == "central" and 0.0 <= summary["accuracy"] <= 1.0
    assert len(summary["client_accuracy"]) == 4  # scored on each federated client's split
