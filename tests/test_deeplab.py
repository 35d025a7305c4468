"""DeepLab-V3+ / MobileNetV2: shapes, norms, vmap over clients, pretrained-encoder loading."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, stack_module_state, vmap

from protofl.config import ModelConfig
from protofl.errors import ProtoflError
from protofl.models.deeplab import DeepLabV3Plus, deeplabv3plus, divisible
from protofl.models.norms import FrozenBatchNorm2d, group_norm_from_bn
from protofl.models.registry import build_model

# MobileNetV2's published stage table (t, c, n, s), written out again here
NORM_KINDS = {torch.nn.GroupNorm, torch.nn.BatchNorm2d, FrozenBatchNorm2d}
TABLE = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
         (6, 160, 3, 2), (6, 320, 1, 1)]


def torchvision_mobilenet_v2_state(width: float = 1.0, seed: int = 0) -> dict:
    """A state_dict with torchvision's mobilenet_v2 key names and shapes, by hand."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}

    def conv(key, c_out, c_in, k):
        sd[key] = torch.randn(c_out, c_in, k, k, generator=g)

    def bn(prefix, c):
        sd[f"{prefix}.weight"] = torch.rand(c, generator=g) + 0.5
        sd[f"{prefix}.bias"] = torch.randn(c, generator=g)
        sd[f"{prefix}.running_mean"] = torch.randn(c, generator=g)
        sd[f"{prefix}.running_var"] = torch.rand(c, generator=g) + 0.5
        sd[f"{prefix}.num_batches_tracked"] = torch.tensor(3)

    c = divisible(32 * width)
    conv("features.0.0.weight", c, 3, 3)
    bn("features.0.1", c)
    i = 1
    for t, ch, n, _ in TABLE:
        out = divisible(ch * width)
        for _ in range(n):
            hid = c * t
            pre = f"features.{i}.conv"
            if t == 1:
                conv(f"{pre}.0.0.weight", hid, 1, 3)
                bn(f"{pre}.0.1", hid)
                conv(f"{pre}.1.weight", out, hid, 1)
                bn(f"{pre}.2", out)
            else:
                conv(f"{pre}.0.0.weight", hid, c, 1)
                bn(f"{pre}.0.1", hid)
                conv(f"{pre}.1.0.weight", hid, 1, 3)
                bn(f"{pre}.1.1", hid)
                conv(f"{pre}.2.weight", out, hid, 1)
                bn(f"{pre}.3", out)
            c, i = out, i + 1
    conv("features.18.0.weight", 1280, c, 1)
    bn("features.18.1", 1280)
    sd["classifier.1.weight"] = torch.randn(1000, 1280, generator=g)
    sd["classifier.1.bias"] = torch.randn(1000, generator=g)
    return sd


@pytest.mark.parametrize("norm", ["group", "batch", "frozen"])
@pytest.mark.parametrize("stride", [8, 16])
def test_shapes(norm, stride):
    m = DeepLabV3Plus((3, 48, 64), 5, width=0.35, output_stride=stride, channels=32,
                      norm=norm)
    x = torch.randn(2, 3, 48, 64)
    z, logits = m(x)
    assert z.shape == (2, 32, 12, 16) and m.feature_dim == 32
    assert logits.shape == (2, 5, 48, 64)
    assert torch.equal(m.head(m.encode(x)), logits)
    assert (z >= 0).all()  # post-ReLU decoder features
    _, high = m.encoder(x)
    assert high.shape[-2:] == (48 // stride, 64 // stride)
    enc = {type(mod) for mod in m.encoder.modules()}
    rest = {type(mod) for name, mod in m.named_modules() if not name.startswith("encoder")}
    want = {"group": torch.nn.GroupNorm, "batch": torch.nn.BatchNorm2d,
            "frozen": FrozenBatchNorm2d}[norm]
    assert want in enc and len(enc & NORM_KINDS) == 1
    assert rest & NORM_KINDS == {torch.nn.GroupNorm if norm != "batch" else want}
    assert not any(isinstance(mod, torch.nn.modules.dropout._DropoutNd) for mod in m.modules())


def test_width_multiplier_and_encoder_size():
    # torchvision's mobilenet_v2 features 0..17 hold 1,811,712 parameters (width 1.0)
    full = DeepLabV3Plus((3, 32, 32), 21, norm="batch")
    assert sum(p.numel() for p in full.encoder.parameters()) == 1_811_712
    small = DeepLabV3Plus((3, 32, 32), 21, width=0.5)
    assert small.encoder.low_channels == 16 and small.encoder.high_channels == 160
    assert full.encoder.low_channels == 24 and full.encoder.high_channels == 320


@pytest.mark.parametrize("norm", ["group", "frozen"])
def test_vmap_over_two_parameter_sets_equals_two_forwards(norm):
    """Forwards and per-pixel cross-entropy gradients (void ignored) of two parameter sets
    under one vmap equal those of two separate models (float64); frozen BatchNorm's
    statistics are buffers vmapped with the parameters."""
    torch.manual_seed(0)
    models = [DeepLabV3Plus((3, 32, 32), 4, width=0.35, channels=16, norm=norm).double()
              for _ in range(2)]
    for m in models:
        for mod in m.modules():
            if isinstance(mod, FrozenBatchNorm2d):  # statistics that differ per model
                mod.running_mean.normal_()
                mod.running_var.uniform_(0.5, 2.0)
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    x = torch.randn(2, 3, 3, 32, 32, dtype=torch.float64)
    y = torch.randint(0, 4, (2, 3, 32, 32))
    y[:, :, :2] = 255

    def run(p, b, xb):
        return functional_call(base, (p, b), (xb,))

    def loss(p, b, xb, yb):
        return F.cross_entropy(run(p, b, xb)[1], yb, ignore_index=255)

    z, logits = vmap(run)(params, buffers, x)
    grads = vmap(grad(loss))(params, buffers, x, y)
    for k, m in enumerate(models):
        zk, lk = m(x[k])
        assert torch.allclose(z[k], zk, atol=1e-10)
        assert torch.allclose(logits[k], lk, atol=1e-10)
        F.cross_entropy(lk, y[k], ignore_index=255).backward()
        for name, p in m.named_parameters():
            assert torch.allclose(grads[name][k], p.grad, atol=1e-10), name
    assert not torch.allclose(logits[0], logits[1])


def test_load_torchvision_weights(tmp_path):
    sd = torchvision_mobilenet_v2_state(width=0.5)
    path = tmp_path / "mnv2.pth"
    torch.save(sd, path)
    cfg = ModelConfig(norm="batch", pretrained=str(path))
    m = deeplabv3plus((3, 32, 32), 5, cfg, width=0.5, channels=16)
    enc = m.encoder.state_dict()
    for key in ("features.0.0.weight", "features.1.conv.1.weight", "features.9.conv.1.0.weight",
                "features.17.conv.3.running_var"):
        assert torch.equal(enc[key], sd[key])
    g = deeplabv3plus((3, 32, 32), 5, ModelConfig(pretrained=str(path)), width=0.5, channels=16)
    assert torch.equal(g.encoder.features[4].conv[2].weight, sd["features.4.conv.2.weight"])
    gn = g.encoder.features[4].conv[3]  # BatchNorm carried into GroupNorm (tested below)
    assert not torch.equal(gn.weight, sd["features.4.conv.3.weight"])
    grey = deeplabv3plus((1, 32, 32), 5, ModelConfig(pretrained=str(path)), width=0.5,
                         channels=16)
    assert torch.allclose(grey.encoder.features[0][0].weight,
                          sd["features.0.0.weight"].sum(1, keepdim=True))
    with pytest.raises(ProtoflError, match="features.0.0.weight.*width"):
        deeplabv3plus((3, 32, 32), 5, cfg, width=1.0)
    del sd["features.3.conv.1.0.weight"]
    torch.save(sd, path)
    with pytest.raises(ProtoflError, match="lacks 'features.3.conv.1.0.weight'"):
        deeplabv3plus((3, 32, 32), 5, cfg, width=0.5)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ProtoflError, match="not a readable state_dict"):
        deeplabv3plus((3, 32, 32), 5, cfg, width=0.5)
    with pytest.raises(ProtoflError, match="no file"):
        deeplabv3plus((3, 32, 32), 5, ModelConfig(pretrained=str(tmp_path / "none.pth")))


def test_registry_and_bad_options():
    m = build_model("deeplabv3plus", (3, 32, 32), 9, ModelConfig(), width=0.35, channels=24,
                    output_stride=8)
    assert isinstance(m, DeepLabV3Plus) and m.feature_dim == 24
    with pytest.raises(ProtoflError, match="no option depth"):
        build_model("deeplabv3plus", (3, 32, 32), 9, depth=3)
    with pytest.raises(ProtoflError, match="no option width"):
        build_model("resnet18", (3, 32, 32), 9, width=0.5)
    for kwargs, msg in (({"output_stride": 32}, "output stride"), ({"width": 0}, "width"),
                        ({"channels": 20}, "channels"), ({"norm": "layer"}, "model.norm")):
        with pytest.raises(ProtoflError, match=msg):
            DeepLabV3Plus((3, 32, 32), 9, **kwargs)
    with pytest.raises(ProtoflError, match=r"\(C, H, W\)"):
        DeepLabV3Plus((60,), 9)


def test_frozen_batchnorm_keeps_the_running_statistics(tmp_path):
    """The loaded statistics are used as they are: the stem's output is computed by hand
    (conv, (x - mean) / sqrt(var + eps) * w + b, ReLU6) for BatchNorm in eval mode and for
    frozen BatchNorm in either mode; the whole encoders of both agree, and neither a
    training-mode forward nor a gradient step moves frozen statistics."""
    sd = torchvision_mobilenet_v2_state(width=0.35, seed=3)
    path = tmp_path / "mnv2.pth"
    torch.save(sd, path)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    conv = F.conv2d(x, sd["features.0.0.weight"].double(), stride=2, padding=1)
    mean, var, w, b = (sd[f"features.0.1.{k}"].double()[None, :, None, None]
                       for k in ("running_mean", "running_var", "weight", "bias"))
    hand = ((conv - mean) / torch.sqrt(var + 1e-5) * w + b).clamp(0, 6)
    models = {}
    for norm in ("batch", "frozen"):
        m = deeplabv3plus((3, 32, 32), 4, ModelConfig(norm=norm, pretrained=str(path)),
                          width=0.35, channels=16).double().eval()
        assert torch.allclose(m.encoder.features[0](x), hand, atol=1e-10), norm
        models[norm] = m
    frozen = models["frozen"]
    low_b, high_b = models["batch"].encoder(x)
    frozen.train()
    low_f, high_f = frozen.encoder(x)
    assert torch.allclose(low_b, low_f, atol=1e-8) and torch.allclose(high_b, high_f, atol=1e-8)
    before = {k: v.clone() for k, v in frozen.named_buffers()}
    opt = torch.optim.SGD(frozen.parameters(), lr=0.1)
    frozen(x)[1].square().mean().backward()
    opt.step()
    assert all(torch.equal(v, before[k]) for k, v in frozen.named_buffers())
    assert frozen.encoder.features[0][1].weight.grad is not None  # the affine trains
    from protofl.engine.vectorized import vectorize_reason

    assert vectorize_reason(frozen) is None and vectorize_reason(models["batch"]) is not None
    from protofl.models.registry import check_model_config

    with pytest.raises(ProtoflError, match="frozen.*needs model.pretrained"):
        check_model_config(ModelConfig(name="deeplabv3plus", norm="frozen"))


def test_group_norm_from_batchnorm_is_exact_at_the_population_statistics():
    """On inputs whose per-sample group mean and variance are the ones the BatchNorm
    statistics imply (built by standardising each sample's group, then scaling), the
    converted GroupNorm equals the eval-mode BatchNorm; elsewhere it is an approximation."""
    g = torch.Generator().manual_seed(0)
    c, groups = 8, 2
    mu = torch.randn(c, generator=g, dtype=torch.float64)
    var = torch.rand(c, generator=g, dtype=torch.float64) + 0.5
    w = torch.rand(c, generator=g, dtype=torch.float64) + 0.5
    b = torch.randn(c, generator=g, dtype=torch.float64)
    gn = torch.nn.GroupNorm(groups, c).double()
    group_norm_from_bn(gn, w, b, mu, var)
    # population group statistics worked out here from the channels' mean and variance
    m_g = torch.stack([mu[:4].mean(), mu[4:].mean()])
    v_g = torch.stack([(var[:4] + mu[:4] ** 2).mean(), (var[4:] + mu[4:] ** 2).mean()]) - m_g ** 2
    z = torch.randn(3, groups, 4 * 5 * 5, generator=g, dtype=torch.float64)
    z = (z - z.mean(-1, keepdim=True)) / z.std(-1, unbiased=False, keepdim=True)
    x = (m_g[None, :, None] + v_g.sqrt()[None, :, None] * z).reshape(3, c, 5, 5)
    bn = F.batch_norm(x, mu, var, w, b, training=False, eps=1e-5)
    assert torch.allclose(gn(x), bn, atol=1e-10)
    assert not torch.allclose(gn(2 * x), F.batch_norm(2 * x, mu, var, w, b, eps=1e-5),
                              atol=1e-2)
