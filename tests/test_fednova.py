"""FedNova: ||a_i||_1 against the paper's closed forms and a hand recursion, the normalized
server rule on 2 clients by hand, FedAvg's numbers when every tau_i is equal, refusals."""

from __future__ import annotations

import pytest
import torch

from protofl.algorithms.base import FederationInfo, split_state
from protofl.algorithms.fednova import solver_norm
from protofl.algorithms.registry import make_algorithm
from protofl.api import run
from protofl.config import config_from_dict
from protofl.engine.federation import build
from protofl.engine.private import stack
from protofl.errors import ProtoflError
from protofl.models.nets import Mlp
from protofl.testing import client_round, trained

INFO = FederationInfo(num_clients=2, num_classes=3, train_sizes=(1, 3))


def fednova(**opts):
    return make_algorithm("fednova", opts, Mlp(2, 3, hidden=(4,)), 3, INFO)


def filled(params: dict, value: float) -> dict:
    return {k: torch.full_like(v, value) for k, v in params.items()}


@pytest.mark.parametrize("tau", [1, 3, 10])
def test_solver_norm_matches_the_papers_closed_forms(tau):
    assert solver_norm(tau, 0.1) == pytest.approx(tau)  # SGD: tau_i
    rho = 0.9  # momentum: [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho)
    assert solver_norm(tau, 0.1, momentum=rho) == pytest.approx(
        (tau - rho * (1 - rho ** tau) / (1 - rho)) / (1 - rho))
    eta, mu = 0.1, 2.0  # proximal: [1 - (1 - eta mu)^tau] / (eta mu)
    assert solver_norm(tau, eta, mu=mu) == pytest.approx((1 - (1 - eta * mu) ** tau) / (eta * mu))


def test_solver_norm_by_hand():
    """tau = 3, rho = 0.5: (0.5 + 0.75 + 0.875) / 0.5 = 4.25. Momentum 0.5 and mu = 2 with
    lr 0.1 over 2 steps: v = 1, e = -0.1; v = 0.5 + 1 + 2 (-0.1) = 1.3, e = -0.23: 2.3."""
    assert solver_norm(3, 0.1, momentum=0.5) == pytest.approx(4.25)
    assert solver_norm(2, 0.1, momentum=0.5, mu=2.0) == pytest.approx(2.3)
    assert solver_norm(0, 0.1) == 0.0


def test_client_uploads_its_norm_with_weight_decay_as_proximal_pull():
    alg = fednova(mu=1.0)
    params, buffers = split_state(alg.model)
    broadcast = {"params": params, "buffers": buffers}
    c = client_round(alg, broadcast, y=torch.zeros(4, dtype=torch.long), steps=3, lr=0.1,
                     momentum=0.5, weight_decay=1.0)
    upload, _ = alg.client_end(trained(c, params, buffers, alg.client_begin(c)))
    assert float(upload["norm"]) == pytest.approx(solver_norm(3, 0.1, 0.5, mu=2.0))
    assert float(upload["num_samples"]) == 4
    adam = client_round(alg, broadcast, steps=3, lr=0.1, momentum=0.5, optimizer="adam")
    assert float(alg.client_end(trained(adam, params, buffers, {}))[0]["norm"]) == 3.0


def test_server_rule_by_hand():
    """x = 0; A at y = 1 (n = 1, ||a|| = 2), B at y = 4 (n = 3, ||a|| = 4): p = 1/4, 3/4,
    tau_eff = 0.5 + 3 = 3.5, x = 3.5 (0.25 * 1/2 + 0.75 * 4/4) = 3.0625 (FedAvg: 3.25)."""
    alg = fednova()
    state = alg.init_state(alg.model)
    state["params"] = filled(state["params"], 0.0)
    ups = [{"params": filled(state["params"], y), "buffers": {},
            "num_samples": torch.tensor(n, dtype=torch.float64),
            "norm": torch.tensor(a, dtype=torch.float64)} for y, n, a in ((1.0, 1.0, 2.0),
                                                                          (4.0, 3.0, 4.0))]
    new, diag = alg.aggregate(state, ups, 1)
    assert diag["weights"] == [0.25, 0.75] and diag["tau_eff"] == pytest.approx(3.5)
    for v in new["params"].values():
        assert torch.allclose(v, torch.full_like(v, 3.0625))
    ups[0]["norm"] = torch.tensor(0.0, dtype=torch.float64)  # a client that took no step
    new, diag = alg.aggregate(state, ups, 1)
    assert diag["tau_eff"] == pytest.approx(3.0)  # 0.75 * 4; its update counts for nothing
    for v in new["params"].values():
        assert torch.allclose(v, torch.full_like(v, 3.0 * 0.75 * 1.0))


def test_equal_local_steps_give_fedavg():
    """Every client takes local_steps = 4 (the same tau_i and ||a_i||): FedNova's rule is
    FedAvg's, so the runs agree."""
    base = {"rounds": 3, "seed": 2, "data": {"name": "digits", "num_clients": 4},
            "clients": {"per_round": 4, "local_steps": 4, "lr": 0.05, "momentum": 0.5,
                        "tolerate_partial": False},
            "metrics": {"dissimilarity_clients": 0}}
    a = run({**base, "algorithm": "fedavg"})
    b = run({**base, "algorithm": "fednova"})
    for ra, rb in zip(a.records, b.records):
        assert rb["accuracy"] == ra["accuracy"]
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.allclose(sa[k], sb[k], atol=1e-6) for k in sa)
    assert all(r["tau_eff"] == pytest.approx(solver_norm(4, 0.05, 0.5))
               for r in b.records)


@pytest.mark.parametrize("privacy", [{"secagg": True}, {"noise_multiplier": 1.0}])
def test_refused_under_dp_and_secure_sums(privacy):
    fed = build(config_from_dict({"algorithm": "fednova", "clients": {"per_round": 3},
                                  "privacy": privacy, "rounds": 1}))
    with pytest.raises(ProtoflError, match="fednova.*own \\|\\|a_i\\|\\|_1"):
        stack(fed.spec, fed.alg, fed.data.num_clients, fed.state)
