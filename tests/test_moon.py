"""MOON: the contrastive term against a direct numpy computation, mu = 0 is plain CE, the
first participation uses the global model as the previous one, and a 2-round run."""

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from protofl.algorithms.base import forward, split_state
from protofl.algorithms.capabilities import prototypes
from protofl.algorithms.moon import contrastive_term, projected
from protofl.algorithms.registry import make_algorithm
from protofl.errors import ProtoflError
from protofl.models.nets import Mlp
from protofl.testing import client_round, trained


def _setup(mu=1.0, tau=0.5):
    torch.manual_seed(0)
    model = Mlp(4, 3, hidden=(5, 6))
    alg = make_algorithm("moon", {"mu": mu, "tau": tau, "proj_dim": 3}, model, 3)
    return alg, alg.model


def _np_cos(a, b):
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_contrastive_term_matches_numpy():
    g = torch.Generator().manual_seed(1)
    h, hg, hp = (torch.randn(5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    tau = 0.5
    a, b = _np_cos(h.numpy(), hg.numpy()) / tau, _np_cos(h.numpy(), hp.numpy()) / tau
    expected = -np.log(np.exp(a) / (np.exp(a) + np.exp(b)))
    np.testing.assert_allclose(contrastive_term(h, hg, hp, tau).numpy(), expected, rtol=1e-10)


def test_defaults_are_not_fedavg():
    alg, _ = _setup()
    default = make_algorithm("moon", {}, Mlp(4, 3), 3)
    assert default.opts.mu == 1.0 and default.opts.tau == 0.5
    assert alg.opts.mu > 0


def _perturbed(model, scale, seed):
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return other


def test_loss_matches_direct_computation():
    alg, model = _setup(mu=0.7, tau=0.5)
    glob_m, prev_m = _perturbed(model, 0.3, 2), _perturbed(model, 0.3, 3)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(4))
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    w = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])  # one padded row
    gp, gb = split_state(glob_m)
    pp, pb = split_state(prev_m)
    ctx = alg.client_begin(client_round(alg, {"params": gp, "buffers": gb}, x, y,
                                        {"prev": {"params": pp, "buffers": pb}}, model=model))
    params, buffers = split_state(model)
    got = float(alg.loss(model, params, buffers, x, y, w, ctx))

    def rep(m):
        with torch.no_grad():
            z = m.encode(x)
            return m.projection(z).numpy().astype(np.float64), m.head(z)

    h, logits = rep(model)
    hg, _ = rep(glob_m)
    hp, _ = rep(prev_m)
    ce = F.cross_entropy(logits, y, reduction="none").numpy()
    a, b = _np_cos(h, hg) / 0.5, _np_cos(h, hp) / 0.5
    lcon = np.log(np.exp(a) + np.exp(b)) - a
    wn = w.numpy()
    expected = ((ce + 0.7 * lcon) * wn).sum() / wn.sum()
    assert got == pytest.approx(expected, rel=1e-5)


def test_mu_zero_is_cross_entropy():
    alg, model = _setup(mu=0.0)
    other = _perturbed(model, 0.5, 5)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(6))
    y = torch.tensor([0, 1, 2, 1, 0])
    w = torch.ones(5)
    gp, gb = split_state(other)
    ctx = alg.client_begin(client_round(alg, {"params": gp, "buffers": gb}, x, y, model=model))
    params, buffers = split_state(model)
    with torch.no_grad():
        ce = F.cross_entropy(model(x)[1], y)
    assert float(alg.loss(model, params, buffers, x, y, w, ctx)) == pytest.approx(float(ce),
                                                                                 rel=1e-6)


def test_first_participation_uses_global_model_so_lcon_is_log2():
    alg, model = _setup(mu=1.0)
    params, buffers = split_state(model)
    glob = {"params": params, "buffers": buffers}
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(7))
    y = torch.tensor([0, 1, 2, 0])
    ctx = alg.client_begin(client_round(alg, glob, x, y, model=model))
    with torch.no_grad():
        ce = float(F.cross_entropy(model(x)[1], y))
    # h_prev == h_global == h: each similarity is 1/tau, so l_con = log 2 for every sample
    got = float(alg.loss(model, params, buffers, x, y, torch.ones(4), ctx))
    assert got == pytest.approx(ce + math.log(2.0), rel=1e-6)
    c = client_round(alg, glob, x, y, model=model)
    up, state = alg.client_end(trained(c, params, buffers, ctx))
    assert state["prev"]["params"] is params and "projection.0.weight" in up["params"]


def test_wrap_model_adds_one_projection_head():
    alg, model = _setup()
    n = sum(1 for _ in model.parameters())
    alg.wrap_model(model)
    assert sum(1 for _ in model.parameters()) == n
    assert model.projection[2].out_features == 3


@pytest.mark.parametrize("opts", [{"mu": -1.0}, {"tau": 0.0}, {"proj_dim": 0}])
def test_bad_options(opts):
    with pytest.raises(ProtoflError):
        make_algorithm("moon", opts, Mlp(4, 3), 3)


def test_two_round_digits_run(tiny_digits):
    _, out = tiny_digits("moon")
    for key in ("accuracy", "loss", "train_loss", "amm", "client_loss", "dissimilarity"):
        assert np.isfinite(out[key]), key


def test_paper_network_classifies_the_projection():
    """MOON's network: encoder -> projection head -> classifier; z (what the metrics read) is
    the encoder's output, h = projection(z) the contrastive space."""
    torch.manual_seed(0)
    plain = Mlp(4, 3, hidden=(5, 6))
    alg = make_algorithm("moon", {"proj_dim": 2}, plain, 3)
    model = alg.model
    assert model is not plain and model.backbone is plain and model.feature_dim == 6
    params, buffers = split_state(model)
    assert {"projection.0.weight", "projection.2.weight", "classifier.weight"} <= set(params)
    assert params["classifier.weight"].shape == (3, 2)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(8))
    z, logits = forward(model, params, buffers, x)
    with torch.no_grad():
        want_z = plain.encode(x)
        h = model.projection[2](torch.relu(model.projection[0](want_z)))
        want = h @ model.classifier.weight.T + model.classifier.bias
    assert torch.allclose(z, want_z) and torch.allclose(logits, want, atol=1e-6)
    assert torch.allclose(projected(model, params, buffers, x)[0], h, atol=1e-6)
    protos, _ = prototypes(alg, {"params": params, "buffers": buffers},
                           lambda: (x, torch.tensor([0, 1, 2, 0, 1])))
    assert protos.shape == (3, 6)  # prototypes of z, not of h
    assert alg.wrap_model(plain) is model and alg.wrap_model(model) is model


def test_side_network_keeps_the_classifier_on_z():
    torch.manual_seed(0)
    plain = Mlp(4, 3, hidden=(5, 6))
    alg = make_algorithm("moon", {"proj_dim": 2, "head": "side"}, plain, 3)
    assert alg.model is plain and plain.projection[2].out_features == 2
    params, buffers = split_state(plain)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = plain.classifier(plain.encode(x))
    assert torch.allclose(forward(plain, params, buffers, x)[1], want)
