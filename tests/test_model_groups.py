"""HtFLlib's image model groups (models/families.py) and the models they need: FedAvgCNN,
ResNet-10/34/50/101/152, GoogLeNet, MobileNetV2 with its 1280 conv, MLP heads.

Parameter counts are checked against formulas written out here (conv k*k*cin*cout, norm 2c,
fc in*out + out) and against torchvision's published counts; the big models are built on the
meta device (no memory, no time); real forward passes only for the cheap ones, on 2 images.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from protofl.config import ModelConfig, config_from_dict
from protofl.data.registry import load_dataset
from protofl.engine.spec import check_sizes, resolve, resolve_data
from protofl.errors import ProtoflError
from protofl.models import families
from protofl.models.googlenet import INCEPTIONS, GoogLeNet
from protofl.models.registry import build_model
from protofl.models.resnet import ResNet, ResNet18


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def conv(k: int, c_in: int, c_out: int, bias: bool = False) -> int:
    return k * k * c_in * c_out + (c_out if bias else 0)


def norm(c: int) -> int:
    return 2 * c  # GroupNorm and BatchNorm: weight and bias


def fc(i: int, o: int) -> int:
    return i * o + o


def resnet_count(depth: int, c_in: int, classes: int, small: bool) -> int:
    """ResNet parameters by hand: stem, blocks (projection when the shape changes), fc."""
    blocks = {10: (1, 1, 1, 1), 18: (2, 2, 2, 2), 34: (3, 4, 6, 3), 50: (3, 4, 6, 3),
              101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}[depth]
    bottleneck = depth >= 50
    total = conv(3 if small else 7, c_in, 64) + norm(64)
    c = 64
    for stage, (w, n) in enumerate(zip((64, 128, 256, 512), blocks)):
        for b in range(n):
            stride = 2 if stage > 0 and b == 0 else 1
            out = 4 * w if bottleneck else w
            if bottleneck:
                total += (conv(1, c, w) + norm(w) + conv(3, w, w) + norm(w)
                          + conv(1, w, out) + norm(out))
            else:
                total += conv(3, c, w) + norm(w) + conv(3, w, w) + norm(w)
            if stride != 1 or c != out:
                total += conv(1, c, out) + norm(out)
            c = out
    return total + fc(c, classes)


def googlenet_count(c_in: int, classes: int, small: bool) -> int:
    def cbr(k: int, i: int, o: int) -> int:
        return conv(k, i, o) + norm(o)

    total = cbr(3 if small else 7, c_in, 64) + cbr(1, 64, 64) + cbr(3, 64, 192)
    c = 192
    for c1, r3, c3, r5, c5, cp in INCEPTIONS.values():
        total += (cbr(1, c, c1) + cbr(1, c, r3) + cbr(3, r3, c3) + cbr(1, c, r5)
                  + cbr(3, r5, c5) + cbr(1, c, cp))
        c = c1 + c3 + c5 + cp
    assert c == 1024
    return total + fc(c, classes)


# ------------------------------------------------------------------ parameter counts
@pytest.mark.parametrize("depth, torchvision", [
    (18, 11_689_512), (34, 21_797_672), (50, 25_557_032), (101, 44_549_160),
    (152, 60_192_808)])
def test_resnets_have_torchvisions_parameter_counts(depth, torchvision):
    """ImageNet stem, BatchNorm, 1000 classes: torchvision's published counts."""
    with torch.device("meta"):
        model = ResNet((3, 224, 224), 1000, "batch", depth)
    assert n_params(model) == torchvision == resnet_count(depth, 3, 1000, small=False)


@pytest.mark.parametrize("depth", [10, 18, 34, 50, 101, 152])
@pytest.mark.parametrize("shape", [(3, 32, 32), (1, 28, 28), (3, 224, 224)])
def test_resnet_parameter_counts_by_hand(depth, shape):
    with torch.device("meta"):
        model = ResNet(shape, 10, "group", depth)
    assert model.small == (shape[1] < 64)
    assert n_params(model) == resnet_count(depth, shape[0], 10, model.small)
    assert model.feature_dim == (2048 if depth >= 50 else 512)


def test_googlenet_parameter_count():
    with torch.device("meta"):
        big = GoogLeNet((3, 224, 224), 1000, "batch")
        small = GoogLeNet((3, 32, 32), 10)
    assert n_params(big) == 6_624_904 == googlenet_count(3, 1000, small=False)  # torchvision's
    assert n_params(small) == googlenet_count(3, 10, small=True)
    assert small.feature_dim == 1024


def test_mobilenetv2_1280_has_torchvisions_parameter_count():
    with torch.device("meta"):
        model = families.MobileNetV2Net((3, 224, 224), 1000, "batch", last=1280)
    assert n_params(model) == 3_504_872 and model.feature_dim == 1280


@pytest.mark.parametrize("size, flat", [(32, 1600), (16, 64), (28, 1024)])
def test_fedavg_cnn_parameter_count(size, flat):
    model = build_model("fedavg_cnn", (3, size, size), 10)
    expected = conv(5, 3, 32, True) + conv(5, 32, 64, True) + fc(flat, 512) + fc(512, 10)
    assert n_params(model) == expected and model.feature_dim == 512
    with pytest.raises(ProtoflError, match="at least 14 px"):
        build_model("fedavg_cnn", (3, 12, 12), 10)


def test_mlp_heads_parameter_count():
    head = families.mlp_head(512, (256,), 10)
    assert n_params(head) == fc(512, 256) + fc(256, 10)
    assert n_params(families.mlp_head(512, (), 10)) == fc(512, 10)


# ------------------------------------------------------------------ ResNet-18 unchanged
def test_resnet18_is_unchanged():
    """Its state names, shapes, count and seeded initial weights, as taken from main before
    the ResNets were generalised."""
    torch.manual_seed(0)
    model = ResNet18((3, 32, 32), 10)
    sd = model.state_dict()
    names = ";".join(f"{k}:{tuple(v.shape)}" for k, v in sd.items())
    assert hashlib.sha256(names.encode()).hexdigest()[:16] == "b51d56cb59b7e5fa"
    assert len(sd) == 62 and n_params(model) == 11_173_962
    weighted = sum((i + 1) * float(v.double().abs().sum()) for i, v in enumerate(sd.values()))
    assert weighted == pytest.approx(4928188.645672507, rel=1e-9)
    assert list(sd)[:4] == ["stem.0.weight", "stem.1.weight", "stem.1.bias",
                            "layer1.0.conv1.weight"]


# ------------------------------------------------------------------ real forward passes
@pytest.mark.parametrize("name", ["fedavg_cnn", "resnet10", "googlenet"])
def test_cheap_models_forward(name):
    torch.manual_seed(0)
    model = build_model(name, (3, 32, 32), 10, ModelConfig())
    z, logits = model(torch.randn(2, 3, 32, 32))
    assert z.shape == (2, model.feature_dim) and logits.shape == (2, 10)
    assert torch.isfinite(logits).all()


# ------------------------------------------------------------------ the groups
HTFLLIB = {  # HtFLlib system/main.py, written out here
    "htfe-img-2": ["fedavg_cnn", "resnet18"],
    "htfe-img-3": ["resnet10", "resnet18", "resnet34"],
    "htfe-img-4": ["fedavg_cnn", "googlenet", "mobilenetv2_1280", "resnet18"],
    "htfe-img-5": ["googlenet", "mobilenetv2_1280", "resnet18", "resnet34", "resnet50"],
    "htfe-img-8": ["fedavg_cnn", "googlenet", "mobilenetv2_1280", "resnet18", "resnet34",
                   "resnet50", "resnet101", "resnet152"],
    "htc-img-4": ["resnet34", "resnet34+head:512", "resnet34+head:256", "resnet34+head:128"],
}


@pytest.mark.parametrize("family", list(HTFLLIB))
def test_htfllib_groups_members(family):
    members, dim, source = families.FAMILIES[family]
    assert list(members) == HTFLLIB[family] and dim == 512 and "HtFLlib" in source


def test_htfe_img_8_htc_img_4_pairs_model_k_mod_8_with_head_k_mod_4():
    members = families.FAMILIES["htfe-img-8-htc-img-4"][0]
    heads = ["", "+head:512", "+head:256", "+head:128"]
    assert list(members) == [m + heads[k % 4] for k, m in enumerate(HTFLLIB["htfe-img-8"])]


@pytest.mark.parametrize("family", list(families.FAMILIES))
def test_every_family_member_encodes_to_d_on_the_meta_device(family):
    with torch.device("meta"):
        groups, dim = families.build_groups(ModelConfig(family=family), (3, 32, 32), 10)
        x = torch.empty(2, 3, 32, 32)
        for name, model in zip(groups.distinct, groups.models):
            z = model.encode(x)
            assert model.feature_dim == dim, name
            assert z.shape == (2, dim) and model.head(z).shape == (2, 10), name
    assert dim == families.FAMILIES[family][1]


@pytest.fixture(scope="module")
def cifar_tiny():
    cfg = config_from_dict({"data": {"name": "cifar_tiny"}})
    return load_dataset(resolve_data(cfg.data), lean=True)


@pytest.mark.parametrize("family", list(families.FAMILIES))
def test_every_family_resolves_and_is_sized_as_a_run_does(family, cifar_tiny):
    """``resolve`` builds the run's algorithm and groups on the meta device, as a run does;
    ``check_sizes`` sizes them."""
    cfg = config_from_dict({"algorithm": "fedproto", "data": {"name": "cifar_tiny"},
                            "model": {"family": family}, "clients": {"per_round": 2}})
    spec = resolve(cfg, cifar_tiny)
    assert spec.model.name == "heterogeneous"
    assert spec.model.feature_dim == families.FAMILIES[family][1]
    assert spec.model.per_client == list(families.FAMILIES[family][0])
    check_sizes(spec, cifar_tiny, cifar_tiny, "cpu")


def test_members_of_one_extractor_share_its_initial_weights_not_their_heads():
    torch.manual_seed(0)
    cfg = ModelConfig(per_client=["fedavg_cnn", "cnn2+head:16", "fedavg_cnn+head:64-32"])
    groups, dim = families.build_groups(cfg, (3, 16, 16), 10)
    plain, cnn, mlp = groups.models
    assert dim == 512 and n_params(mlp) == n_params(plain) - fc(512, 10) + (
        fc(512, 64) + fc(64, 32) + fc(32, 10))
    a, b = plain.state_dict(), mlp.state_dict()
    for k, v in a.items():
        if not k.startswith("classifier."):
            assert torch.equal(v, b[k]), k
    assert [k for k in b if k.startswith("classifier.")] == [
        "classifier.0.weight", "classifier.0.bias", "classifier.2.weight",
        "classifier.2.bias", "classifier.4.weight", "classifier.4.bias"]
    z, logits = mlp(torch.randn(2, 3, 16, 16))
    assert z.shape == (2, 512) and logits.shape == (2, 10)
    assert cnn(torch.randn(2, 3, 16, 16))[1].shape == (2, 10)


@pytest.mark.parametrize("name, needle", [
    ("resnet99", "unknown model 'resnet99'"),
    ("resnet34+head:", "positive hidden widths"),
    ("resnet34+head:64-x", "positive hidden widths"),
    ("resnet34+head:0", "positive hidden widths"),
])
def test_bad_members_are_one_line_errors(name, needle):
    with pytest.raises(ProtoflError, match=needle):
        families.resolve(ModelConfig(per_client=[name]))


def test_a_torchvision_resnet50_state_dict_loads(tmp_path):
    """torchvision's Bottleneck names (conv1-3, bn1-3, downsample), written out here, load
    into protofl's ResNet-50 with BatchNorm, every tensor in its place."""
    g = torch.Generator().manual_seed(0)
    sd: dict[str, torch.Tensor] = {"conv1.weight": torch.randn(64, 3, 7, 7, generator=g)}

    def bn(prefix: str, c: int) -> None:
        for stat in ("weight", "bias", "running_mean", "running_var"):
            sd[f"{prefix}.{stat}"] = torch.rand(c, generator=g) + 0.5

    bn("bn1", 64)
    c = 64
    for i, (w, n) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), start=1):
        for b in range(n):
            pre = f"layer{i}.{b}"
            shapes = ((w, c, 1, 1), (w, w, 3, 3), (4 * w, w, 1, 1))
            for j, shape in enumerate(shapes, start=1):
                sd[f"{pre}.conv{j}.weight"] = torch.randn(*shape, generator=g)
                bn(f"{pre}.bn{j}", shape[0])
            if b == 0:
                sd[f"{pre}.downsample.0.weight"] = torch.randn(4 * w, c, 1, 1, generator=g)
                bn(f"{pre}.downsample.1", 4 * w)
            c = 4 * w
    sd["fc.weight"], sd["fc.bias"] = torch.randn(1000, 2048), torch.randn(1000)
    torch.save(sd, tmp_path / "r50.pth")
    model = build_model("resnet50", (3, 64, 64), 5,
                        ModelConfig(norm="batch", pretrained=str(tmp_path / "r50.pth")))
    ours = model.state_dict()
    assert torch.equal(ours["layer3.5.conv3.weight"], sd["layer3.5.conv3.weight"])
    assert torch.equal(ours["layer4.0.norm3.running_var"], sd["layer4.0.bn3.running_var"])
    assert torch.equal(ours["layer1.0.shortcut.1.weight"], sd["layer1.0.downsample.1.weight"])
    assert torch.equal(ours["stem.0.weight"], sd["conv1.weight"])
