"""Capabilities are declared by inheriting and implementing them (algorithms/capabilities.py):
the engine's privacy checks, the heterogeneous federations and the prototype readers ask
for them, never for a flag."""

import pytest
import torch

from protofl.algorithms import capabilities as cap
from protofl.algorithms.base import Algorithm
from protofl.algorithms.fedavg import FedAvg
from protofl.algorithms.registry import algorithm_class, make_algorithm
from protofl.config import config_from_dict
from protofl.engine import private
from protofl.errors import ProtoflError
from protofl.models.nets import Mlp

EXPECTED = {  # the capabilities each method's paper gives it (a cross-check of these methods)
    "fedavg": {"Sums"}, "fedprox": {"Sums"}, "central": {"Sums"}, "moon": {"Sums"},
    "fedatt": set(), "feddyn": set(), "fedplvm": set(),
    "fedmargin": {"Sums", "Prototypes"}, "fedproin": {"Sums"},
    "fedproto": {"Sums", "Prototypes", "Personalized"},
    "fedtgp": {"Sums", "Prototypes", "Personalized"},
    "fd": {"Sums", "Personalized"}, "lgfedavg": {"Sums", "Personalized"},
    "fedgh": {"Sums", "Prototypes", "Personalized"}, "fpl": {"Prototypes"},
    "fml": {"Sums", "Personalized"}, "fedkd": {"Sums", "Personalized"},
    "fedgen": {"Sums", "Personalized"}, "fedmrl": {"Sums", "Personalized"},
}


def declared(cls: type) -> set[str]:
    return {c.__name__ for c in (cap.Sums, cap.Prototypes, cap.Personalized)
            if issubclass(cls, c)}


@pytest.mark.parametrize("name", EXPECTED)
def test_each_algorithm_declares_its_paper_s_capabilities(name):
    assert declared(algorithm_class(name)) == EXPECTED[name]


def test_the_core_has_no_capability_flag_or_method():
    for attr in ("personalized", "needs_individual", "private_fallback", "client_weight",
                 "aggregate_private", "sums_reason", "prototypes"):
        assert not hasattr(Algorithm, attr)


def dp_config(**privacy):
    return config_from_dict({"algorithm": "fedavg", "rounds": 1, "data": {"name": "synthetic",
                            "num_clients": 4}, "clients": {"per_round": 2},
                             "privacy": {"noise_multiplier": 1.0, "clip": 1.0, **privacy}})


class Weighted(FedAvg):
    """A new weight-averaging method: it inherits Sums from FedAvg."""


class Plain(Algorithm):
    """The same server rule, without declaring Sums."""

    individual_reason = "its server reads every client at once"


def test_privacy_follows_the_declaration_not_the_rule():
    model = Mlp(4, 3, hidden=(5,))
    private.check(dp_config(secagg=True), Weighted({}, model, 3))  # accepted
    with pytest.raises(ProtoflError, match="client-level DP: its server reads every client"):
        private.check(dp_config(), Plain({}, model, 3))
    with pytest.raises(ProtoflError, match="secure aggregation: its server reads every"):
        private.check(dp_config(secagg=True, noise_multiplier=0.0), Plain({}, model, 3))
    assert cap.sums_reason(Weighted({}, model, 3)) == ""


def test_prototypes_read_from_the_upload_or_computed_from_the_model():
    model = Mlp(2, 2, hidden=())  # z = x: the class means are the data's
    x = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0]])
    y = torch.tensor([0, 0, 1])
    avg = make_algorithm("fedavg", {}, model, 2)
    params = {k: v.detach() for k, v in model.named_parameters()}
    protos, counts = cap.prototypes(avg, {"params": params, "buffers": {}}, lambda: (x, y))
    assert torch.allclose(protos, torch.tensor([[2.0, 0.0], [0.0, 2.0]]))
    assert counts.tolist() == [2.0, 1.0]
    proto = make_algorithm("fedproto", {}, model, 2)
    upload = {"protos": torch.ones(2, 2), "counts": torch.tensor([1.0, 0.0])}
    got = cap.prototypes(proto, upload, lambda: pytest.fail("loaded the data"))
    assert got[0] is upload["protos"] and got[1] is upload["counts"]


def test_a_personalized_client_scores_with_its_own_model():
    model = Mlp(2, 2, hidden=())
    alg = make_algorithm("fedproto", {}, model, 2)
    state = alg.init_state(alg.model)
    own = {"params": {"w": torch.zeros(1)}, "buffers": {}}
    assert alg.global_weights(state) is None and alg.client_weights({}) is None
    assert alg.eval_weights(state, own) == own
    assert alg.eval_weights(state, {}) == {"params": state["init"]["params"],
                                           "buffers": state["init"]["buffers"]}
