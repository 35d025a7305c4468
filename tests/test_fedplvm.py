"""FedPLVM: L_corr by hand, L_alpha against a direct loop, client clustering into padded
prototypes, server re-clustering, and a 2-round run."""

import math

import numpy as np
import pytest
import torch

from protofl.algorithms.base import split_state, validate_upload
from protofl.algorithms.fedplvm import alpha_loss, cluster_classes, correction_loss, masked_mean
from protofl.algorithms.registry import make_algorithm
from protofl.errors import ProtoflError
from protofl.models.nets import Mlp
from protofl.testing import client_round


def test_correction_by_hand():
    z = torch.tensor([[1.0, 0.0], [1.0, 1.0], [3.0, 0.0], [0.0, 2.0]])
    y = torch.tensor([1, 0, 0, 2])
    means = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    has = torch.tensor([1.0, 1.0, 0.0])
    # cos = 0 -> 2; cos = 1/sqrt2 -> 2 (1/sqrt2 - 1)^2; cos = 1 -> 0; class 2 has none -> 0
    expected = [2.0, 2 * (1 / math.sqrt(2) - 1) ** 2, 0.0, 0.0]
    assert correction_loss(z, y, means, has).tolist() == pytest.approx(expected, abs=1e-6)


def _sparse(a, b, alpha):
    c = sum(u * v for u, v in zip(a, b)) / (math.hypot(*a) * math.hypot(*b))
    return math.copysign(max(abs(c), 1e-4) ** alpha, c)


def test_alpha_loss_matches_loop():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, 2, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0, 1])
    protos = torch.randn(3, 2, 2, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    alpha, tau = 0.25, 0.07
    got = alpha_loss(z, y, protos, mask, alpha, tau).tolist()
    for i in range(5):
        if y[i] == 2:  # no global prototype of class 2
            assert got[i] == 0.0
            continue
        num = den = 0.0
        for c in range(3):
            for m in range(2):
                if mask[c, m] == 0:
                    continue
                e = math.exp(_sparse(z[i].tolist(), protos[c, m].tolist(), alpha) / tau)
                den += e
                num += e if c == y[i] else 0.0
        assert got[i] == pytest.approx(-math.log(num / den), rel=1e-9)


def test_loss_combines_terms_with_lambda():
    torch.manual_seed(0)
    model = Mlp(2, 3, hidden=(4, 3))
    alg = make_algorithm("fedplvm", {}, model, 3)
    assert (alg.opts.lam, alg.opts.alpha, alg.opts.tau) == (100.0, 0.25, 0.07)
    protos = torch.rand(3, 8, 3)
    mask = torch.zeros(3, 8)
    mask[0, :2] = 1.0
    mask[1, :1] = 1.0
    glob = {"global_protos": protos, "global_mask": mask}
    x, y = torch.randn(4, 2), torch.tensor([0, 1, 2, 0])
    ctx = alg.client_begin(client_round(alg, glob, x, y, model=model))
    params, buffers = split_state(model)
    no_reg = make_algorithm("fedplvm", {"lam": 0.0}, model, 3)
    w = torch.ones(4)
    with torch.no_grad():
        z, _ = model(x)
    reg = (alpha_loss(z, y, protos, mask, 0.25, 0.07)
           + correction_loss(z, y, masked_mean(protos, mask), ctx["has"])).mean()
    got = float(alg.loss(model, params, buffers, x, y, w, ctx))
    base = float(no_reg.loss(model, params, buffers, x, y, w, ctx))
    assert got == pytest.approx(base + 100.0 * float(reg), rel=1e-5)
    assert float(reg) > 0


def test_client_clusters_pad_and_mask():
    z = torch.tensor([[1.0, 0.0], [1.0, 0.02], [0.0, 1.0], [0.02, 1.0], [1.0, 1.0]])
    y = torch.tensor([0, 0, 0, 0, 2])
    protos, mask = cluster_classes(z, y, 3, 4, "first")
    # class 0: two mutual pairs -> two prototypes; class 1 absent; class 2: one sample
    assert mask.tolist() == [[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]
    got = sorted(protos[0, :2].tolist())
    assert sum(got, []) == pytest.approx([0.01, 1.0, 1.0, 0.01])
    assert protos[2, 0].tolist() == [1.0, 1.0]


def test_server_reclusters_and_keeps_absent_classes():
    torch.manual_seed(0)
    model = Mlp(2, 3, hidden=(4, 2))
    alg = make_algorithm("fedplvm", {"max_local": 2, "max_global": 2}, model, 3)
    state = alg.init_state(model)
    state["global_protos"][2, 0] = torch.tensor([7.0, 7.0])
    state["global_mask"][2, 0] = 1.0
    params, buffers = split_state(model)

    def upload(p0, m0):
        lp = torch.zeros(3, 2, 2)
        lm = torch.zeros(3, 2)
        lp[0], lm[0] = p0, m0
        return {"params": params, "buffers": buffers, "num_samples": torch.tensor(3.0),
                "local_protos": lp, "local_mask": lm, "counts": torch.tensor([3.0, 0, 0])}

    a = upload(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([1.0, 1.0]))
    b = upload(torch.tensor([[1.0, 0.1], [0.0, 0.0]]), torch.tensor([1.0, 0.0]))
    for u in (a, b):
        validate_upload(u, alg.upload_spec())
    new, diag = alg.aggregate(state, [a, b], 1)
    # class 0 rows [1,0], [0,1], [1,0.1]: the first-neighbour graph of three points is always
    # connected, so FINCH's only partition is one cluster and its mean is the prototype
    assert new["global_mask"][0].tolist() == [1.0, 0.0]
    assert new["global_protos"][0, 0].tolist() == pytest.approx([2 / 3, 1.1 / 3])
    assert new["global_mask"][1].tolist() == [0.0, 0.0]  # nobody has class 1
    assert new["global_protos"][2, 0].tolist() == [7.0, 7.0]  # kept
    assert diag["global_prototypes"] == [1.0, 0.0, 1.0]


def test_bad_option():
    with pytest.raises(ProtoflError):
        make_algorithm("fedplvm", {"level": "middle"}, Mlp(2, 3), 3)


def test_two_round_digits_run(tiny_digits):
    exp, out = tiny_digits("fedplvm")
    for key in ("accuracy", "loss", "train_loss", "amm", "client_loss", "dissimilarity"):
        assert np.isfinite(out[key]), key
    assert float(exp.state["global_mask"].sum()) > 0
