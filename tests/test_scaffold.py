"""SCAFFOLD's client step, control variates (options I and II) and server rule against
hand-worked numbers on 2 clients; its state across a resume; what it refuses."""

from __future__ import annotations

import pytest
import torch

from protofl import tasks
from protofl.algorithms.base import FederationInfo, forward, split_state
from protofl.algorithms.registry import make_algorithm
from protofl.algorithms.scaffold import gradient_at
from protofl.api import resume_experiment, run_experiment
from protofl.config import config_from_dict
from protofl.engine.federation import build
from protofl.engine.private import stack
from protofl.engine.runfolder import load_checkpoint, read_metrics
from protofl.errors import ProtoflError
from protofl.models.nets import Mlp
from protofl.nested import flatten
from protofl.testing import client_round, trained

INFO = FederationInfo(num_clients=4, num_classes=3, train_sizes=(5, 5, 5, 5))


def scaffold(**opts):
    return make_algorithm("scaffold", opts, Mlp(2, 3, hidden=(4,)), 3, INFO)


def filled(params: dict, value: float) -> dict:
    return {k: torch.full_like(v, value) for k, v in params.items()}


def close(tree: dict, value: float) -> bool:
    return all(torch.allclose(v, torch.full_like(v, value), atol=1e-6) for v in tree.values())


def test_server_rule_by_hand():
    """eta_g 0.5, N = 4, from x = 0, c = 0: clients at y = 1 and 3 with dc = 0.4 and 0.8.
    x = 0 + 0.5 mean(1, 3) = 1; c = 0 + 2/4 mean(0.4, 0.8) = 0.3 (= sum dc / N).
    Round 2 from there, clients at 2 and 2, dc = -0.2 and 0.6: x = 1 + 0.5 (1) = 1.5,
    c = 0.3 + 0.4 / 4 = 0.4."""
    alg = scaffold(eta_g=0.5)
    state = alg.init_state(alg.model)
    state["params"] = filled(state["params"], 0.0)
    assert close(state["c"], 0.0)

    def up(y, dc):
        return {"params": filled(state["params"], y), "buffers": {},
                "control": filled(state["params"], dc),
                "num_samples": torch.tensor(5.0, dtype=torch.float64)}

    state, diag = alg.aggregate(state, [up(1.0, 0.4), up(3.0, 0.8)], 1)
    assert diag["weights"] == [0.5, 0.5]  # the paper's plain mean, not n-weighted
    assert close(state["params"], 1.0) and close(state["c"], 0.3)
    state, _ = alg.aggregate(state, [up(2.0, -0.2), up(2.0, 0.6)], 2)
    assert close(state["params"], 1.5) and close(state["c"], 0.4)


def test_corrected_local_step():
    """The loss's gradient is g_i(y) - c_i + c: the plain gradient plus c - c_i."""
    alg = scaffold()
    params, buffers = split_state(alg.model)
    x, y, w = torch.randn(6, 2), torch.tensor([0, 1, 2, 0, 1, 2]), torch.ones(6)
    broadcast = {"params": params, "buffers": buffers, "c": filled(params, 0.7)}
    ctx = alg.client_begin(client_round(alg, broadcast, x, y, {"c": filled(params, 0.2)}))
    fedavg = make_algorithm("fedavg", {}, alg.model, 3)
    p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    got = torch.autograd.grad(alg.loss(alg.model, p, buffers, x, y, w, ctx), list(p.values()))
    plain = torch.autograd.grad(fedavg.loss(alg.model, p, buffers, x, y, w, {}),
                                list(p.values()))
    for g, g0 in zip(got, plain):
        assert torch.allclose(g - g0, torch.full_like(g, 0.5))  # c - c_i = 0.7 - 0.2
    first = alg.client_begin(client_round(alg, broadcast, x, y))  # c_i = 0 the first time
    assert close(first["correction"], 0.7)


def test_option_ii_by_hand():
    """c_i = 0.2, c = 0.5, x = 1, y = 0.4 after K = 3 SGD steps of lr 0.1:
    c_i+ = 0.2 - 0.5 + 0.6 / 0.3 = 1.7, dc = 1.5. With momentum 0.5, K becomes
    ||a||_1 = (0.5 + 0.75 + 0.875) / 0.5 = 4.25: c_i+ = -0.3 + 0.6 / 0.425."""
    alg = scaffold()
    params, buffers = split_state(alg.model)
    broadcast = {"params": filled(params, 1.0), "buffers": buffers, "c": filled(params, 0.5)}
    for momentum, want in ((0.0, 1.7), (0.5, -0.3 + 0.6 / 0.425)):
        c = client_round(alg, broadcast, state={"c": filled(params, 0.2)}, steps=3, lr=0.1,
                         momentum=momentum)
        upload, state = alg.client_end(trained(c, filled(params, 0.4), buffers))
        assert close(state["c"], want) and close(upload["control"], want - 0.2)
        assert close(upload["params"], 0.4)
    # with Adam, K is its step count: c_i+ = -0.3 + 0.6 / (3 * 0.1) = 1.7 as for SGD
    c = client_round(alg, broadcast, state={"c": filled(params, 0.2)}, steps=3, lr=0.1,
                     optimizer="adam")
    assert close(alg.client_end(trained(c, filled(params, 0.4), buffers))[1]["c"], 1.7)


def test_option_i_is_the_gradient_at_the_server_model():
    """c_i+ = g_i(x): the full-batch gradient of the mean cross-entropy at x, here summed 2
    rows at a time, against one autograd pass over all 5 rows."""
    alg = scaffold(variate="I")
    params, buffers = split_state(alg.model)
    x, y = torch.randn(5, 2), torch.tensor([0, 1, 2, 0, 1])
    p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    loss = tasks.per_sample_cross_entropy(forward(alg.model, p, buffers, x)[1], y).mean()
    want = dict(zip(p, torch.autograd.grad(loss, list(p.values()))))
    got = gradient_at(alg.model, params, buffers, x, y, rows=2)
    assert all(torch.allclose(got[k], want[k], atol=1e-6) for k in want)
    broadcast = {"params": params, "buffers": buffers, "c": filled(params, 0.5)}
    c = client_round(alg, broadcast, x, y, {"c": filled(params, 0.1)}, steps=4)
    upload, state = alg.client_end(trained(c, filled(params, 9.0), buffers))
    assert all(torch.allclose(state["c"][k], want[k], atol=1e-6) for k in want)
    assert all(torch.allclose(upload["control"][k], want[k] - 0.1, atol=1e-6) for k in want)


@pytest.mark.parametrize("privacy", [{"secagg": True}, {"noise_multiplier": 1.0}])
def test_refused_under_dp_and_secure_sums(privacy):
    fed = build(config_from_dict({"algorithm": "scaffold", "clients": {"per_round": 3},
                                  "privacy": privacy, "rounds": 1}))
    with pytest.raises(ProtoflError, match="scaffold.*control-variate updates dc_i would "
                                           "reach the server unclipped and without noise"):
        stack(fed.spec, fed.alg, fed.data.num_clients, fed.state)


def test_control_variates_survive_a_resume(tmp_path, kill_after):
    raw = {"algorithm": "scaffold", "rounds": 4, "checkpoint_every": 2, "seed": 3,
           "data": {"name": "digits", "num_clients": 5},
           "clients": {"per_round": 3, "local_steps": 3, "lr": 0.05},
           "metrics": {"dissimilarity_clients": 0}}
    run_experiment(config_from_dict(raw), tmp_path / "full")
    with kill_after(3), pytest.raises(KeyboardInterrupt):
        run_experiment(config_from_dict(raw), tmp_path / "killed")
    saved = load_checkpoint(tmp_path / "killed")  # round 2's: c and every c_i kept
    assert float(sum(v.abs().sum() for v in flatten(saved["state"]["c"]).values())) > 0
    assert any(k.endswith(".c." + next(iter(flatten(saved["state"]["c"]))))
               for k in flatten(saved["client_states"]))
    resume_experiment(tmp_path / "killed")
    rows = [[{k: v for k, v in r.items() if k != "seconds"} for r in read_metrics(tmp_path / n)]
            for n in ("full", "killed")]
    assert rows[0] == rows[1] and len(rows[0]) == 4
