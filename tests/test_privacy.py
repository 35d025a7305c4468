"""Client-level DP: clipping bounds, noise calibration, and the accountant against published
figures and independent formulas."""

import logging
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from protofl.errors import ProtoflError
from protofl.privacy import (
    client_noise_std,
    clip,
    clip_prototypes,
    distributed_multiplier,
    effective_multiplier,
    l2_norm,
)
from protofl.privacy.accountant import Accountant, Budget

pytest.importorskip("dp_accounting")

FAST = settings(max_examples=40, deadline=None)
floats = st.floats(-1e6, 1e6, allow_nan=False, width=32)


def _tensor(shape):
    return arrays(np.float32, shape, elements=floats).map(torch.from_numpy)


@FAST
@given(st.lists(st.integers(1, 6), min_size=1, max_size=3).flatmap(
    lambda dims: st.tuples(st.lists(_tensor(tuple(dims)), min_size=1, max_size=3),
                           st.floats(1e-3, 1e3))))
def test_clip_bounds_the_update_norm(case):
    parts, bound = case
    update = {f"w{i}": t for i, t in enumerate(parts)}
    clipped, norm = clip(update, bound)
    assert norm == pytest.approx(l2_norm(update))
    assert l2_norm(clipped) <= bound * (1 + 1e-5)
    scale = min(1.0, bound / norm) if norm > 0 else 1.0
    for k in update:  # same direction, only shrunk
        torch.testing.assert_close(clipped[k], update[k] * scale)


def test_clip_by_hand():
    delta = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}
    clipped, norm = clip(delta, 1.0)  # delta (3, 0, 4): norm 5
    assert norm == pytest.approx(5.0)
    torch.testing.assert_close(clipped["a"], torch.tensor([0.6, 0.0]))
    torch.testing.assert_close(clipped["b"], torch.tensor([0.8]))


@FAST
@given(st.integers(1, 6).flatmap(lambda c: st.tuples(
    _tensor((c, 4)), arrays(np.int64, (c,), elements=st.integers(0, 10_000)),
    st.floats(1e-3, 1e3))))
def test_prototype_statistics_are_bounded(case):
    protos, counts, bound = case
    sums, frac = clip_prototypes(protos, torch.from_numpy(counts), bound)
    assert float(sums.norm()) <= bound * (1 + 1e-5)
    assert float(frac.norm()) <= 1 + 1e-6
    assert float(frac.sum()) == pytest.approx(1.0 if counts.sum() else 0.0, abs=1e-6)


def test_prototype_statistics_by_hand():
    protos = torch.tensor([[3.0, 4.0], [0.0, 0.5], [7.0, 7.0]])
    sums, frac = clip_prototypes(protos, torch.tensor([3, 1, 0]), bound=1.0)
    torch.testing.assert_close(frac, torch.tensor([0.75, 0.25, 0.0]))
    torch.testing.assert_close(sums, torch.tensor([[0.45, 0.6], [0.0, 0.125], [0.0, 0.0]]))
    # fedproin's (C, M, d) prototypes with influence counts work the same way
    s3, f3 = clip_prototypes(protos.view(3, 1, 2), torch.tensor([[3], [1], [0]]), 1.0)
    torch.testing.assert_close(s3.view(3, 2), sums)


def test_client_noise_shares_and_a_partial_sum():
    """K' clients each adding std sigma C / sqrt(K') give the sum std sigma C; 9 of 16 shares
    carry sigma * 3/4 (checked on draws in test_private.py)."""
    assert client_noise_std(2.0, 0.8, 16) == pytest.approx(0.8 * 2.0 / 4)
    assert distributed_multiplier(0.8, 16, 9) == pytest.approx(0.8 * 0.75)


def test_effective_multiplier_of_several_parts():
    assert effective_multiplier([2.0, 2.0]) == pytest.approx(2 / math.sqrt(2))
    assert effective_multiplier([1.0, 1.0, 1.0]) == pytest.approx(1 / math.sqrt(3))
    assert effective_multiplier([3.0]) == 3.0 and effective_multiplier([1.0, 0.0]) == 0.0


# ---- the accountant ----
TUTORIAL_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))


@pytest.mark.parametrize("sigma, epochs, published", [
    (1.12, 60, 2.92), (1.12, 1, 1.00), (1.12, 2, 1.04), (1.2, 10, 1.20)])
def test_accountant_matches_the_tf_privacy_mnist_figures(sigma, epochs, published):
    """TensorFlow Privacy's DP-SGD MNIST tutorial (tensorflow/privacy, tutorials/README.md,
    "Expected Output" and "Select Parameters"): 60,000 examples, batch 256 (q = 256/60000),
    234 steps per epoch (``60000 // 256`` in mnist_dpsgd_tutorial.py), delta = 1e-5; noise
    multiplier 1.12 gives epsilon 1.00 after 1 epoch, 1.04 after 2 and 2.92 after 60; noise
    1.2 for 10 epochs gives 1.20. Those figures came from the RDP accountant of the time with the
    orders above and the classic conversion eps = min_a RDP(a) + log(1/delta) / (a - 1); the
    current dp-accounting conversion (Canonne et al. 2020) is tighter, so our epsilon is
    smaller than the published one."""
    from dp_accounting.rdp import RdpAccountant

    acc = Accountant(sigma, num_clients=60_000, per_round=256, delta=1e-5, sampling="poisson")
    steps = epochs * (60_000 // 256)
    rdp = RdpAccountant(TUTORIAL_ORDERS)
    rdp.compose(acc.event(steps))
    classic = min(r + math.log(1 / 1e-5) / (a - 1) for a, r in zip(rdp.orders, rdp.rdp))
    assert round(classic, 2) == published
    assert 0.6 * published < acc.epsilon(steps) < published


def test_rdp_of_the_sampled_gaussian_by_the_integer_order_formula():
    """Mironov, Talwar & Zhang (2019), integer orders: A_a = sum_k C(a,k) (1-q)^(a-k) q^k
    exp((k^2 - k) / (2 sigma^2)), RDP(a) = log(A_a) / (a - 1), per step."""
    from dp_accounting.rdp import RdpAccountant

    q, sigma, steps = 0.05, 1.5, 7
    orders = [2, 3, 5, 8, 13]
    rdp = RdpAccountant(orders)
    rdp.compose(Accountant(sigma, 100, 5, 1e-5, sampling="poisson").event(steps))
    for a, got in zip(orders, rdp.rdp):
        big_a = sum(math.comb(a, k) * (1 - q) ** (a - k) * q ** k
                    * math.exp((k * k - k) / (2 * sigma ** 2)) for k in range(a + 1))
        assert got == pytest.approx(steps * math.log(big_a) / (a - 1), rel=1e-9)


def test_one_full_round_is_the_analytic_gaussian_mechanism():
    """q = 1 and one round is the plain Gaussian mechanism; its exact (epsilon, delta) curve
    (Balle & Wang 2018): delta = Phi(-eps s + 1/(2s)) - e^eps Phi(-eps s - 1/(2s))."""
    from scipy.stats import norm

    s = 2.0
    eps = Accountant(s, 10, 10, 1e-5, sampling="poisson", method="pld").epsilon(1)
    delta = norm.cdf(-eps * s + 1 / (2 * s)) - math.exp(eps) * norm.cdf(-eps * s - 1 / (2 * s))
    assert delta == pytest.approx(1e-5, rel=0.05)
    rdp_eps = Accountant(s, 10, 10, 1e-5, sampling="poisson").epsilon(1)
    assert eps <= rdp_eps < 1.3 * eps  # RDP is an upper bound, a little looser


def test_fixed_size_sampling_and_its_sensitivity():
    # all clients every round, replace-one: a Gaussian with sensitivity 2C, i.e. sigma / 2
    fixed = Accountant(4.0, 10, 10, 1e-5, sampling="fixed").epsilon(3)
    plain = Accountant(2.0, 10, 10, 1e-5, sampling="poisson").epsilon(3)
    assert fixed == pytest.approx(plain, rel=1e-9)
    acc = Accountant(4.0, 30, 10, 1e-5)  # the main suite's 30 clients, 10 per round
    e = [acc.epsilon(t) for t in (0, 1, 10, 40)]
    assert e[0] == 0 and e[1] < e[2] < e[3]
    assert Accountant(8.0, 30, 10, 1e-5).epsilon(40) < e[3]
    assert Accountant(0.0, 30, 10, 1e-5).epsilon(1) == math.inf


def test_budget_stops_or_warns(caplog):
    acc = Accountant(4.0, 30, 10, 1e-5, sampling="poisson")
    n = acc.max_rounds(2.0)
    assert acc.epsilon(n) <= 2.0 < acc.epsilon(n + 1)
    stop = Budget(acc, 2.0)
    assert stop.allows(n) and not stop.allows(n + 1)
    warn = Budget(acc, 2.0, "warn")
    with caplog.at_level(logging.WARNING, "protofl"):
        assert warn.allows(n + 1) and warn.allows(n + 2)
    assert caplog.text.count("privacy budget exceeded") == 1


@pytest.mark.parametrize("kwargs, needle", [
    ({"noise_multiplier": -1.0}, "noise_multiplier"),
    ({"per_round": 40}, "per_round"),
    ({"delta": 1.0}, "delta"),
    ({"sampling": "weighted"}, "sampling"),
    ({"method": "pld"}, "pld supports only poisson"),
])
def test_bad_privacy_settings_are_one_line(kwargs, needle):
    args = {"noise_multiplier": 1.0, "num_clients": 30, "per_round": 10, "delta": 1e-5, **kwargs}
    with pytest.raises(ProtoflError, match=needle) as e:
        Accountant(**args)
    assert "\n" not in str(e.value)
    with pytest.raises(ProtoflError, match="on_budget"):
        Budget(Accountant(1.0, 30, 10, 1e-5), 1.0, "explode")
