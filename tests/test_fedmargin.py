import math

import pytest
import torch

from protofl.algorithms import prototype_math as pm
from protofl.algorithms.fedmargin import MarginOptions, attention, reduce_classes
from protofl.algorithms.registry import make_algorithm
from protofl.errors import ProtoflError
from protofl.models.nets import Mlp


def sig(v):
    return 1 / (1 + math.exp(-v))


def test_attention_sum_product_and_single_clues():
    lpm, apm = torch.tensor([0.0, 2.0]), torch.tensor([1.0, -1.0])
    raw = [sig(0) + sig(1), sig(2) + sig(-1)]
    a = attention(lpm, apm, MarginOptions())
    assert torch.allclose(a, torch.tensor([raw[0], raw[1]]) / sum(raw))
    prod = [sig(0) * sig(1), sig(2) * sig(-1)]
    a = attention(lpm, apm, MarginOptions(combine="product"))
    assert torch.allclose(a, torch.tensor(prod) / sum(prod))
    a = attention(lpm, apm, MarginOptions(clues="lpm"))
    assert torch.allclose(a, torch.tensor([sig(0), sig(2)]) / (sig(0) + sig(2)))
    a = attention(lpm, apm, MarginOptions(clues="apm"))
    assert torch.allclose(a, torch.tensor([sig(1), sig(-1)]) / (sig(1) + sig(-1)))


def test_reduce_ignores_undefined_classes():
    s = torch.tensor([1.0, float("nan"), 3.0])
    assert reduce_classes(s, "sum").item() == 4.0
    assert reduce_classes(s, "mean").item() == 2.0
    assert reduce_classes(torch.tensor([float("nan")]), "sum").item() == 0.0


def _upload(params, protos, before, counts, n):
    return {"params": params, "buffers": {}, "protos": protos, "protos_before": before,
            "counts": counts, "num_samples": torch.tensor(float(n), dtype=torch.float64)}


def test_aggregate_matches_independent_computation():
    torch.manual_seed(0)
    model = Mlp(4, 3, hidden=(5,))
    alg = make_algorithm("fedmargin", {}, model, 3)
    state = alg.init_state(model)
    state["protos"] = torch.rand(3, 5)
    state["reported"] = torch.ones(3)  # every class of P^{t-1} reported by some client
    ups = []
    for k in range(3):
        params = {n: torch.randn_like(v) for n, v in state["params"].items()}
        counts = torch.tensor([3.0, 0.0, 2.0]) if k else torch.tensor([1.0, 4.0, 0.0])
        ups.append(_upload(params, torch.rand(3, 5), torch.rand(3, 5), counts, counts.sum()))
    new, diag = alg.aggregate(state, ups, 1)

    # independent: margins per class with explicit loops
    def spm_loop(p, q, pres_p, pres_q):
        def norm(v):
            return (v - v.min()) / (v.max() - v.min() + 1e-8)
        total = 0.0
        for c in range(3):
            if not pres_p[c] or not pres_q[c]:
                continue
            others = [float((norm(p[c]) - norm(q[j])).norm()) for j in range(3)
                      if j != c and pres_q[j]]
            if others:
                total += min(others) - float((norm(p[c]) - norm(q[c])).norm())
        return total

    raw = []
    for u in ups:
        pres = (u["counts"] > 0).tolist()
        lpm = spm_loop(u["protos"], u["protos_before"], pres, pres)
        apm = spm_loop(u["protos"], state["protos"], pres, [True] * 3)
        raw.append(sig(lpm) + sig(apm))
    a = torch.tensor(raw) / sum(raw)
    assert torch.allclose(torch.tensor(diag["weights"], dtype=torch.float64), a.double(),
                          atol=1e-6)
    for name in state["params"]:
        want = sum(a[k] * ups[k]["params"][name] for k in range(3))
        assert torch.allclose(new["params"][name], want.float(), atol=1e-5)
    want_p = pm.aggregate_prototypes(torch.stack([u["protos"] for u in ups]),
                                     torch.stack([u["counts"] for u in ups]), state["protos"])
    assert torch.allclose(new["protos"], want_p)
    # class 1 is held by client 0 only
    assert torch.allclose(new["protos"][1], ups[0]["protos"][1])


def test_weight_options_fedavg_and_fair():
    torch.manual_seed(1)
    model = Mlp(4, 3, hidden=(5,))
    ups = []
    state = None
    for opts in ({"weights": "fedavg"}, {"weights": "fair"}):
        alg = make_algorithm("fedmargin", opts, model, 3)
        state = alg.init_state(model)
        ups = [_upload(state["params"], torch.rand(3, 5), torch.rand(3, 5),
                       torch.tensor([1.0, 1.0, 0.0]), n) for n in (1, 3)]
        a, _ = alg.aggregation_weights(ups, state)
        want = [0.25, 0.75] if opts["weights"] == "fedavg" else [0.5, 0.5]
        assert torch.allclose(a, torch.tensor(want, dtype=a.dtype))


def test_dplus_score_uses_minus_dplus():
    model = Mlp(4, 2, hidden=(3,))
    alg = make_algorithm("fedmargin", {"score": "dplus", "clues": "lpm"}, model, 2)
    p = torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])
    q = torch.tensor([[0.0, 2.0, 2.0], [2.0, 1.0, 0.0]])
    ups = [_upload({}, p, q, torch.tensor([1.0, 1.0]), 2)]
    lpm, _ = alg.margins(ups, torch.zeros(2, 3))
    # normalised: p0 = [0, .5, 1], q0 = [0, 1, 1] -> d+ = .5; class 1 identical -> 0
    assert math.isclose(lpm[0].item(), -0.5, rel_tol=1e-6)


def test_bad_option_is_one_clear_error():
    with pytest.raises(ProtoflError, match="algo.clues"):
        make_algorithm("fedmargin", {"clues": "nope"}, Mlp(4, 2), 2)
    with pytest.raises(ProtoflError, match="unknown key"):
        make_algorithm("fedmargin", {"typo": 1}, Mlp(4, 2), 2)
    assert type(make_algorithm("pgfl", {}, Mlp(4, 2), 2)).__name__ == "FedMargin"


def test_apm_compares_with_reported_classes_only_by_hand():
    """P^{t-1}: class 0 = (0, 1, 2), class 1 = (2, 1, 0) (both reported), class 2 never
    reported (still 0). A client holding class 0 with p = (0, 2, 4): after min-max,
    p^ = q^0 = (0, .5, 1), q^1 = (1, .5, 0), q^2 = 0, so d+ = 0 and d- = ||p^ - q^1|| = sqrt 2
    over the reported classes, but ||p^ - 0|| = sqrt 1.25 when the zero vector counts."""
    model = Mlp(4, 3, hidden=(3,))
    p = torch.tensor([[0.0, 2.0, 4.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    counts = torch.tensor([5.0, 0.0, 0.0])
    for ref, expected in (("reported", math.sqrt(2.0)), ("all", math.sqrt(1.25))):
        alg = make_algorithm("fedmargin", {"apm_reference": ref}, model, 3)
        state = alg.init_state(alg.model)
        state["protos"] = torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
        state["reported"] = torch.tensor([1.0, 1.0, 0.0])
        new, diag = alg.aggregate(state, [_upload(state["params"], p, p, counts, 5)], 2)
        assert math.isclose(diag["apm"][0], expected, rel_tol=1e-6), ref
        assert diag["lpm"] == [0.0]  # one present class: no d-, no margin
        assert new["reported"].tolist() == [1.0, 1.0, 0.0]


def test_reported_classes_accumulate_in_the_state():
    model = Mlp(4, 3, hidden=(3,))
    alg = make_algorithm("fedmargin", {}, model, 3)
    state = alg.init_state(alg.model)
    assert state["reported"].tolist() == [0.0, 0.0, 0.0]
    protos = torch.rand(3, 3)
    state, diag = alg.aggregate(state, [_upload(state["params"], protos, protos,
                                                torch.tensor([2.0, 0.0, 0.0]), 2)], 1)
    assert diag["apm"] == [0.0]  # nothing reported before round 1: no APM term
    assert state["reported"].tolist() == [1.0, 0.0, 0.0]
    state, _ = alg.aggregate(state, [_upload(state["params"], protos, protos,
                                             torch.tensor([0.0, 0.0, 4.0]), 4)], 2)
    assert state["reported"].tolist() == [1.0, 0.0, 1.0]
    old = {k: v for k, v in state.items() if k != "reported"}  # a 0.1.0 checkpoint
    old["protos"] = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [3.0, 1.0, 0.0]])
    assert alg.reference_classes(old).tolist() == [True, False, True]


def test_client_scores_use_the_same_reference_classes():
    """scores: client: the broadcast carries the reported-class mask, so a client's own APM is
    the server's (by hand: sqrt 2 with class 2 unreported)."""
    model = Mlp(4, 3, hidden=(3,))
    alg = make_algorithm("fedmargin", {"scores": "client"}, model, 3)
    state = alg.init_state(alg.model)
    state["protos"] = torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    state["reported"] = torch.tensor([1.0, 1.0, 0.0])
    b = alg.broadcast(state)
    assert b["reference"].tolist() == [1.0, 1.0, 0.0]
    p = torch.tensor([[0.0, 2.0, 4.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    _, apm = alg.scores_of(p, p, torch.tensor([5.0, 0.0, 0.0]), b["protos"], b["reference"] > 0)
    assert math.isclose(float(apm), math.sqrt(2.0), rel_tol=1e-6)
