import math

import torch

from protofl.algorithms import prototype_math as pm


def test_class_means_by_hand():
    z = torch.tensor([[1.0, 2.0], [3.0, 4.0], [10.0, 0.0]])
    y = torch.tensor([0, 0, 2])
    p, n = pm.class_means(z, y, 3)
    assert torch.equal(n, torch.tensor([2.0, 0.0, 1.0]))
    assert torch.allclose(p, torch.tensor([[2.0, 3.0], [0.0, 0.0], [10.0, 0.0]]))


def test_minmax_per_class_and_per_channel():
    p = torch.tensor([[1.0, 3.0, 5.0], [0.0, 0.0, 0.0], [2.0, 2.0, 4.0]])
    present = torch.tensor([True, False, True])
    out = pm.minmax(p, present, "class", eps=0.0)
    assert torch.allclose(out[0], torch.tensor([0.0, 0.5, 1.0]))
    assert torch.allclose(out[2], torch.tensor([0.0, 0.0, 1.0]))
    assert torch.equal(out[1], torch.zeros(3))
    ch = pm.minmax(p, present, "channel", eps=0.0)  # channels over classes 0 and 2 only
    assert torch.allclose(ch[0], torch.tensor([0.0, 1.0, 1.0]))
    assert torch.allclose(ch[2], torch.tensor([1.0, 0.0, 0.0]))


def test_spm_worked_example():
    # normalised (eps 0) prototypes: P = {0: [0,1], 1: [1,0]}, Q = {0: [0,1], 1: [0,1], 2: [1,0]}
    p = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    q = torch.tensor([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    pres_p = torch.tensor([True, True, False])
    pres_q = torch.tensor([True, True, True])
    d_plus, d_minus = pm.margins(p, q, pres_p, pres_q)
    # class 0: d+ = 0, d- = min(|[0,1]-[0,1]|, |[0,1]-[1,0]|) = 0
    # class 1: d+ = sqrt(2), d- = min(|[1,0]-[0,1]|, |[1,0]-[1,0]|) = 0
    assert d_plus[0] == 0 and math.isclose(d_plus[1].item(), math.sqrt(2), rel_tol=1e-6)
    assert d_minus[0] == 0 and d_minus[1] == 0
    assert torch.isnan(d_plus[2]) and torch.isnan(d_minus[2])
    s = pm.spm(p, q, pres_p, pres_q)
    assert math.isclose(s[1].item(), -math.sqrt(2), rel_tol=1e-4)


def test_margin_undefined_without_other_class():
    p = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    present = torch.tensor([True, False])
    _, d_minus = pm.margins(p, p, present, present)
    assert torch.isnan(d_minus[0])


def test_cosine_distance():
    a = torch.tensor([[1.0, 0.0]])
    b = torch.tensor([[0.0, 2.0], [3.0, 0.0]])
    assert torch.allclose(pm.pairwise_distance(a, b, "cosine"), torch.tensor([[1.0, 0.0]]))


def test_aggregate_prototypes_count_weighted_and_keeps_missing():
    protos = torch.tensor([[[1.0], [5.0], [0.0]], [[4.0], [7.0], [0.0]]])
    counts = torch.tensor([[1.0, 3.0, 0.0], [2.0, 1.0, 0.0]])
    prev = torch.tensor([[9.0], [9.0], [9.0]])
    out = pm.aggregate_prototypes(protos, counts, prev)
    assert torch.allclose(out, torch.tensor([[3.0], [5.5], [9.0]]))


def test_nearest_prototype_counts():
    protos = torch.tensor([[[0.0, 0.0], [10.0, 0.0]], [[0.0, 10.0], [5.0, 5.0]]])
    z = torch.tensor([[0.1, 0.0], [9.0, 0.0], [9.5, 1.0], [5.0, 4.0]])
    assert torch.equal(pm.nearest_prototype_counts(z, protos), torch.tensor([[1.0, 2.0],
                                                                             [0.0, 1.0]]))
