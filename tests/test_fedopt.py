"""FedAdagrad, FedYogi and FedAdam: Algorithm 2's server step against numbers worked by hand
on 2 clients, the state it keeps, its defaults and DP (a ratio of sums, so allowed)."""

from __future__ import annotations

import math

import pytest
import torch

from protofl.algorithms.base import FederationInfo
from protofl.algorithms.registry import make_algorithm
from protofl.config import config_from_dict
from protofl.engine.federation import build
from protofl.engine.private import stack
from protofl.models.nets import Mlp

INFO = FederationInfo(num_clients=4, num_classes=3, train_sizes=(1, 3, 5, 5))
X = [1.0, 2.0]  # the global weights
# client A (n = 1) at [2, 2], client B (n = 3) at [1, 5]: p = 1/4, 3/4, so the weighted mean
# is [1.25, 4.25] and the pseudo-gradient delta = [0.25, 2.25] (delta^2 = [0.0625, 5.0625])
OPTS = {"eta": 0.1, "beta1": 0.9, "beta2": 0.99, "tau": 0.5}  # v starts at tau^2 = 0.25


def run_round(name: str, opts: dict, state=None):
    alg = make_algorithm(name, opts, Mlp(2, 3, hidden=(4,)), 3, INFO)
    if state is None:
        state = {"params": {"w": torch.tensor(X)}, "buffers": {},
                 "m": {"w": torch.zeros(2)}, "v": {"w": torch.full((2,), opts["tau"] ** 2)}}
    ups = [{"params": {"w": torch.tensor(y)}, "buffers": {},
            "num_samples": torch.tensor(n, dtype=torch.float64)}
           for y, n in (([2.0, 2.0], 1.0), ([1.0, 5.0], 3.0))]
    return alg.aggregate(state, ups, 1)


def expected(m: list[float], v: list[float], eta: float, tau: float) -> list[float]:
    return [x + eta * mi / (math.sqrt(vi) + tau) for x, mi, vi in zip(X, m, v)]


def check(state, m, v, x):
    assert state["m"]["w"].tolist() == pytest.approx(m, rel=1e-6)
    assert state["v"]["w"].tolist() == pytest.approx(v, rel=1e-6)
    assert state["params"]["w"].tolist() == pytest.approx(x, rel=1e-6)


def test_fedadam_by_hand():
    """m = 0.1 delta = [0.025, 0.225]; v = 0.99 * 0.25 + 0.01 delta^2 = [0.248125, 0.298125];
    x = X + 0.1 m / (sqrt(v) + 0.5) = [1.0025047, 2.0215103]."""
    state, diag = run_round("fedadam", OPTS)
    assert diag["weights"] == [0.25, 0.75]
    check(state, [0.025, 0.225], [0.248125, 0.298125], [1.0025047, 2.0215103])
    assert expected([0.025, 0.225], [0.248125, 0.298125], 0.1, 0.5) == pytest.approx(
        [1.0025047, 2.0215103], rel=1e-6)
    # a second round carries m and v: from x' the same clients give delta' = mean - x'
    x1 = state["params"]["w"].tolist()
    d = [1.25 - x1[0], 4.25 - x1[1]]
    m = [0.9 * a + 0.1 * b for a, b in zip([0.025, 0.225], d)]
    v = [0.99 * a + 0.01 * b * b for a, b in zip([0.248125, 0.298125], d)]
    state, _ = run_round("fedadam", OPTS, state)
    check(state, m, v, [x + 0.1 * mi / (math.sqrt(vi) + 0.5) for x, mi, vi in zip(x1, m, v)])


def test_fedyogi_by_hand():
    """v - 0.01 delta^2 sign(v - delta^2): 0.25 - 0.000625 (delta^2 < v) and 0.25 + 0.050625
    (delta^2 > v): v = [0.249375, 0.300625]; m as FedAdam's."""
    state, _ = run_round("fedyogi", OPTS)
    v = [0.249375, 0.300625]
    check(state, [0.025, 0.225], v, expected([0.025, 0.225], v, 0.1, 0.5))


def test_fedadagrad_by_hand():
    """beta1 = 0 (its default): m = delta; v = 0.25 + delta^2 = [0.3125, 5.3125]."""
    state, _ = run_round("fedadagrad", {"eta": 0.1, "beta1": 0.0, "tau": 0.5})
    v = [0.3125, 5.3125]
    check(state, [0.25, 2.25], v, expected([0.25, 2.25], v, 0.1, 0.5))


def test_paper_defaults_and_initial_state():
    fed = build(config_from_dict({"algorithm": "fedadam", "clients": {"per_round": 2},
                                  "data": {"name": "digits", "num_clients": 4}}))
    c = fed.spec.clients
    assert (c.local_epochs, c.batch_size, c.lr) == (1, 20, pytest.approx(10 ** -1.5))
    assert fed.spec.algo == {"eta": pytest.approx(10 ** -2.5), "beta1": 0.9, "beta2": 0.999,
                             "tau": 1e-4}
    for k, w in fed.state["params"].items():  # m = 0, v = tau^2
        assert float(fed.state["m"][k].abs().max()) == 0
        assert torch.equal(fed.state["v"][k], torch.full_like(w, 1e-8))


def test_dp_and_secure_sums_feed_the_adaptive_step():
    """A ratio of sums: DP's noised mean update goes through the same server step."""
    fed = build(config_from_dict({"algorithm": "fedyogi", "clients": {"per_round": 3},
                                  "privacy": {"noise_multiplier": 1.0}, "rounds": 1}))
    stack(fed.spec, fed.alg, fed.data.num_clients, fed.state)  # not refused
    mean = {"params": {k: v + 1.0 for k, v in fed.state["params"].items()},
            "buffers": fed.state["buffers"],
            "num_samples": torch.tensor(1.0, dtype=torch.float64)}
    state, _ = fed.alg.aggregate_private(fed.state, mean, 1)
    k = next(iter(state["params"]))
    o = fed.alg.opts  # delta = 1 everywhere: m = 0.1, v = tau^2 + 0.001 (tau^2 < 1)
    v = o.tau ** 2 + (1 - o.beta2)
    want = fed.state["params"][k] + o.eta * 0.1 / (math.sqrt(v) + o.tau)
    assert torch.allclose(state["params"][k], want)
