import itertools
import math

import numpy as np
import pytest
import torch

from protofl.errors import ProtoflError
from protofl.metrics.mmd import feature_rows, ffd, mean_client_mmd, median_bandwidth, mmd2


def numpy_mmd2(x: np.ndarray, y: np.ndarray, unbiased: bool) -> float:
    """Independent reference: explicit loops over pairs, numpy only."""
    z = np.concatenate([x, y])
    dists = [np.sqrt(((z[i] - z[j]) ** 2).sum())
             for i, j in itertools.combinations(range(len(z)), 2)]
    sigma = float(np.median(dists))

    def k(a, b):
        return math.exp(-((a - b) ** 2).sum() / (2 * sigma**2))

    def within(s):
        pairs = [(i, j) for i in range(len(s)) for j in range(len(s)) if not (unbiased and i == j)]
        return sum(k(s[i], s[j]) for i, j in pairs) / len(pairs)

    cross = sum(k(a, b) for a in x for b in y) / (len(x) * len(y))
    return within(x) + within(y) - 2 * cross


def test_hand_worked_two_points():
    # pooled {0, 1}: one distance, sigma = 1; biased MMD² = 1 + 1 - 2 exp(-1/2)
    assert mmd2(torch.tensor([[0.0]]), torch.tensor([[1.0]])) == pytest.approx(
        2 - 2 * math.exp(-0.5), abs=1e-12)


@pytest.mark.parametrize("estimator", ["biased", "unbiased"])
@pytest.mark.parametrize("m, n, d, shift", [(5, 7, 3, 0.0), (6, 4, 2, 1.5), (3, 3, 5, 0.3)])
def test_matches_independent_numpy(estimator, m, n, d, shift):
    rng = np.random.default_rng(m * 100 + n)
    x, y = rng.normal(size=(m, d)), rng.normal(shift, 1.0, size=(n, d))
    ours = mmd2(torch.from_numpy(x).float(), torch.from_numpy(y).float(), estimator)
    assert ours == pytest.approx(numpy_mmd2(x, y, estimator == "unbiased"), abs=1e-6)


def test_identical_sets_give_zero_biased_and_separate_sets_more():
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    assert mmd2(x, x.clone()) == pytest.approx(0.0, abs=1e-12)
    assert mmd2(x, x + 3.0) > mmd2(x, x + 0.1) > 0


def test_bandwidth_median_and_degenerate_cases():
    z = torch.tensor([[0.0], [1.0], [3.0]])
    assert median_bandwidth(torch.cdist(z, z)) == pytest.approx(2.0)  # distances 1, 2, 3
    same = torch.zeros(4, 2)
    assert mmd2(same[:2], same[2:]) == 0.0  # one repeated point
    # most pairs coincide: the median of the non-zero distances (1) is used
    z = torch.tensor([[0.0], [0.0], [0.0], [0.0], [1.0]])  # 6 of 10 distances are 0
    assert median_bandwidth(torch.cdist(z, z)) == pytest.approx(1.0)


def test_bad_input_is_a_clear_error():
    one, two = torch.zeros(1, 3), torch.ones(2, 3)
    assert mmd2(one, two) > 0  # biased works with one sample
    with pytest.raises(ProtoflError, match="unbiased estimator needs at least 2"):
        mmd2(one, two, "unbiased")
    with pytest.raises(ProtoflError, match="same d"):
        mmd2(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ProtoflError, match="estimator 'nope'"):
        mmd2(two, two, "nope")


def test_ffd():
    assert ffd(0.5, 2.0) == pytest.approx(75.0)
    assert ffd(3.0, 2.0) == pytest.approx(-50.0)
    assert math.isnan(ffd(1.0, 0.0))


def test_feature_rows_flattens_pixel_maps_at_fixed_locations():
    z = torch.arange(2 * 3 * 2 * 2, dtype=torch.float).reshape(2, 3, 2, 2)
    rows = feature_rows(z)
    assert rows.shape == (8, 3) and torch.equal(rows[1], z[0, :, 0, 1])
    a, b = feature_rows(z, max_rows=5, seed=1), feature_rows(z + 100, max_rows=5, seed=1)
    assert a.shape == (5, 3) and torch.equal(a + 100, b)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Linear(4, 3)
        self.head = torch.nn.Linear(3, 2)

    def forward(self, x):
        z = self.enc(x)
        return z, self.head(z)


def test_mean_client_mmd_averages_over_clients():
    torch.manual_seed(0)
    net, probe = _Net(), torch.randn(20, 4)
    ref = {k: v.detach().clone() for k, v in net.named_parameters()}
    far = {k: v + 0.5 for k, v in ref.items()}
    assert mean_client_mmd(net, [(ref, {})], (net, ref, {}), probe) == pytest.approx(0, abs=1e-12)
    with torch.no_grad():
        zr = net.enc(probe)
        zf = torch.nn.functional.linear(probe, far["enc.weight"], far["enc.bias"])
    expected = (0.0 + numpy_mmd2(zf.numpy().astype(float), zr.numpy().astype(float), False)) / 2
    got = mean_client_mmd(net, [(ref, {}), (far, {})], (net, ref, {}), probe)
    assert got == pytest.approx(expected, abs=1e-6)
