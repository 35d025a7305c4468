"""FedDyn's client and server formulas against hand-worked numbers, and what it refuses."""

from __future__ import annotations

import pytest
import torch

from protofl.algorithms.base import FederationInfo, split_state
from protofl.algorithms.registry import make_algorithm
from protofl.config import config_from_dict
from protofl.engine.federation import build
from protofl.engine.private import stack
from protofl.errors import ProtoflError
from protofl.models.nets import Mlp
from protofl.testing import client_round, trained

INFO = FederationInfo(num_clients=4, num_classes=3, train_sizes=(5, 5, 5, 5))


def feddyn(alpha: float = 0.5):
    return make_algorithm("feddyn", {"alpha": alpha}, Mlp(2, 3, hidden=(4,)), 3, INFO)


def filled(params: dict, value: float) -> dict:
    return {k: torch.full_like(v, value) for k, v in params.items()}


def test_server_update_by_hand():
    """alpha 0.5, m = 4. Round 1 from W = 0, h = 0 with clients at 1 and 3: mean 2,
    h = -0.5/4 (1 + 3) = -0.5, W = 2 + 0.5/0.5 = 3. Round 2 with clients at 3 and 5:
    mean 4, h = -0.5 - 0.125 (0 + 2) = -0.75, W = 4 + 1.5 = 5.5."""
    alg = feddyn()
    state = alg.init_state(alg.model)
    state["params"] = filled(state["params"], 0.0)
    up = lambda v: {"params": filled(state["params"], v), "buffers": {},  # noqa: E731
                    "num_samples": torch.tensor(5.0, dtype=torch.float64)}
    state, diag = alg.aggregate(state, [up(1.0), up(3.0)], 1)
    assert diag["weights"] == [0.5, 0.5]
    for k in state["params"]:
        assert torch.allclose(state["h"][k], torch.full_like(state["h"][k], -0.5))
        assert torch.allclose(state["params"][k], torch.full_like(state["params"][k], 3.0))
    state, _ = alg.aggregate(state, [up(3.0), up(5.0)], 2)
    for k in state["params"]:
        assert torch.allclose(state["h"][k], torch.full_like(state["h"][k], -0.75))
        assert torch.allclose(state["params"][k], torch.full_like(state["params"][k], 5.5))


def test_client_loss_and_gradient_state_by_hand():
    """Every weight 1, anchor 0, g = 2 on every entry: the loss adds -<g, W> + alpha/2
    ||W - W^t||^2 = (-2 + 0.25) n over the n weights; g becomes 2 - 0.5 (1 - 0) = 1.5."""
    alg = feddyn()
    params, buffers = split_state(alg.model)
    params = filled(params, 1.0)
    n = sum(v.numel() for v in params.values())
    x, y, w = torch.randn(6, 2), torch.tensor([0, 1, 2, 0, 1, 2]), torch.ones(6)
    broadcast = {"params": filled(params, 0.0), "buffers": buffers}
    ctx = alg.client_begin(client_round(alg, broadcast, x, y, {"grad": filled(params, 2.0)}))
    plain = make_algorithm("fedavg", {}, alg.model, 3).loss(alg.model, params, buffers, x, y,
                                                            w, ctx)
    got = alg.loss(alg.model, params, buffers, x, y, w, ctx)
    assert float(got - plain) == pytest.approx((-2.0 + 0.25) * n, rel=1e-6)
    _, state = alg.client_end(trained(client_round(alg, broadcast, x, y), params, buffers, ctx))
    for v in state["grad"].values():
        assert torch.allclose(v, torch.full_like(v, 1.5))
    first = alg.client_begin(client_round(alg, broadcast, x, y))  # a client's first round: g = 0
    assert all(float(v.abs().sum()) == 0 for v in first["grad"].values())


@pytest.mark.parametrize("privacy", [{"secagg": True}, {"noise_multiplier": 1.0}])
def test_refused_under_dp_and_secure_sums(privacy):
    fed = build(config_from_dict({"algorithm": "feddyn", "clients": {"per_round": 3},
                                  "privacy": privacy, "rounds": 1}))
    with pytest.raises(ProtoflError, match="feddyn.*counts the round's clients"):
        stack(fed.spec, fed.alg, fed.data.num_clients, fed.state)


def test_paper_defaults_and_the_federation_it_is_told():
    fed = build(config_from_dict({"algorithm": "feddyn", "clients": {"per_round": 2},
                                  "data": {"name": "digits", "num_clients": 5}}))
    c = fed.spec.clients
    assert (c.batch_size, c.local_epochs, c.lr, c.weight_decay) == (50, 5, 0.1, 1e-3)
    assert fed.spec.algo == {"alpha": 0.01} and fed.alg.federation.num_clients == 5
    with pytest.raises(ProtoflError, match="client count"):
        make_algorithm("feddyn", {}, Mlp(2, 3, hidden=(4,)), 3).aggregate(
            fed.state, [], 1)
