"""ResNet-18: output shapes at 28/64/128 px with both norms, and the pretrained loader."""

from __future__ import annotations

import pytest
import torch

from protofl.config import ModelConfig
from protofl.errors import ProtoflError
from protofl.models.registry import build_model
from protofl.models.resnet import ResNet18, resnet18

WIDTHS = (64, 128, 256, 512)


def torchvision_resnet18_state(num_classes: int = 1000, seed: int = 0) -> dict:
    """A state_dict with torchvision's ResNet-18 names and shapes, written out by hand."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}

    def bn(prefix: str, c: int) -> None:
        sd[f"{prefix}.weight"] = torch.rand(c, generator=g) + 0.5
        sd[f"{prefix}.bias"] = torch.randn(c, generator=g)
        sd[f"{prefix}.running_mean"] = torch.randn(c, generator=g)
        sd[f"{prefix}.running_var"] = torch.rand(c, generator=g) + 0.5
        sd[f"{prefix}.num_batches_tracked"] = torch.tensor(7)

    sd["conv1.weight"] = torch.randn(64, 3, 7, 7, generator=g)
    bn("bn1", 64)
    c_in = 64
    for i, c in enumerate(WIDTHS, start=1):
        for b in range(2):
            pre = f"layer{i}.{b}"
            first_in = c_in if b == 0 else c
            sd[f"{pre}.conv1.weight"] = torch.randn(c, first_in, 3, 3, generator=g)
            bn(f"{pre}.bn1", c)
            sd[f"{pre}.conv2.weight"] = torch.randn(c, c, 3, 3, generator=g)
            bn(f"{pre}.bn2", c)
            if b == 0 and i > 1:
                sd[f"{pre}.downsample.0.weight"] = torch.randn(c, c_in, 1, 1, generator=g)
                bn(f"{pre}.downsample.1", c)
        c_in = c
    sd["fc.weight"] = torch.randn(num_classes, 512, generator=g)
    sd["fc.bias"] = torch.randn(num_classes, generator=g)
    return sd


@pytest.mark.parametrize("size", [28, 64, 128])
@pytest.mark.parametrize("norm", ["group", "batch"])
def test_shapes(size, norm):
    torch.manual_seed(0)
    model = resnet18((3, size, size), 7, ModelConfig(norm=norm))
    model.train()
    z, logits = model(torch.randn(2, 3, size, size))
    assert z.shape == (2, 512) and logits.shape == (2, 7)
    assert model.feature_dim == 512
    assert model.small == (size < 64)
    kinds = {type(m).__name__ for m in model.modules()}
    assert ("GroupNorm" in kinds) == (norm == "group")
    assert ("BatchNorm2d" in kinds) == (norm == "batch")
    assert ("MaxPool2d" in kinds) == (size >= 64)


def test_parameter_count_matches_resnet18():
    # torchvision's ResNet-18 has 11,689,512 parameters with a 1000-way fc
    model = ResNet18((3, 224, 224), 1000, "batch")
    assert sum(p.numel() for p in model.parameters()) == 11_689_512


def test_registry_and_bad_norm():
    model = build_model("resnet18", (1, 28, 28), 3, ModelConfig())
    assert model(torch.randn(1, 1, 28, 28))[1].shape == (1, 3)
    with pytest.raises(ProtoflError, match="norm"):
        resnet18((3, 32, 32), 3, ModelConfig(norm="layer"))


def test_pretrained_batchnorm(tmp_path):
    sd = torchvision_resnet18_state()
    path = tmp_path / "r18.pth"
    torch.save(sd, path)
    model = resnet18((3, 64, 64), 5, ModelConfig(norm="batch", pretrained=str(path)))
    assert torch.equal(model.stem[0].weight, sd["conv1.weight"])
    assert torch.equal(model.stem[1].running_mean, sd["bn1.running_mean"])
    assert torch.equal(model.layer3[1].conv2.weight, sd["layer3.1.conv2.weight"])
    assert torch.equal(model.layer2[0].shortcut[0].weight, sd["layer2.0.downsample.0.weight"])
    assert torch.equal(model.layer4[0].shortcut[1].running_var,
                      sd["layer4.0.downsample.1.running_var"])
    assert model.classifier.weight.shape == (5, 512)  # fc skipped


def test_pretrained_groupnorm_small_stem_and_grey(tmp_path):
    sd = torchvision_resnet18_state()
    path = tmp_path / "r18.pth"
    torch.save({"state_dict": {f"module.{k}": v for k, v in sd.items()}}, path)
    small = resnet18((3, 28, 28), 5, ModelConfig(norm="group", pretrained=str(path)))
    assert small.stem[0].weight.shape == (64, 3, 3, 3)  # 7x7 kernel not loaded
    fresh = torch.nn.GroupNorm(32, 64)
    assert torch.equal(small.stem[1].weight, fresh.weight)  # nor the statistics after it
    # GroupNorm's affine from BatchNorm's (protofl.models.norms.group_norm_from_bn), by hand
    mu, var = sd["layer1.0.bn2.running_mean"].double(), sd["layer1.0.bn2.running_var"].double()
    w, b = sd["layer1.0.bn2.weight"].double(), sd["layer1.0.bn2.bias"].double()
    m_g = mu.reshape(32, 2).mean(1).repeat_interleave(2)
    v_g = (var + mu ** 2).reshape(32, 2).mean(1).repeat_interleave(2) - m_g ** 2
    s = torch.sqrt(var + 1e-5)
    gn = small.layer1[0].norm2
    assert torch.allclose(gn.weight.double(), w * torch.sqrt(v_g + 1e-5) / s, atol=1e-6)
    assert torch.allclose(gn.bias.double(), b + w * (m_g - mu) / s, atol=1e-6)
    grey = resnet18((1, 64, 64), 5, ModelConfig(norm="group", pretrained=str(path)))
    assert torch.allclose(grey.stem[0].weight, sd["conv1.weight"].sum(1, keepdim=True))


def test_pretrained_errors(tmp_path):
    with pytest.raises(ProtoflError, match="no file"):
        resnet18((3, 64, 64), 5, ModelConfig(pretrained=str(tmp_path / "nope.pth")))
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(ProtoflError, match="readable"):
        resnet18((3, 64, 64), 5, ModelConfig(pretrained=str(junk)))
    sd = torchvision_resnet18_state()
    del sd["layer2.1.conv1.weight"]
    torch.save(sd, tmp_path / "missing.pth")
    with pytest.raises(ProtoflError, match="layer2.1.conv1.weight"):
        resnet18((3, 64, 64), 5, ModelConfig(pretrained=str(tmp_path / "missing.pth")))
    sd = torchvision_resnet18_state()
    sd["layer1.0.conv1.weight"] = torch.zeros(64, 64, 5, 5)
    torch.save(sd, tmp_path / "shape.pth")
    with pytest.raises(ProtoflError, match="shape"):
        resnet18((3, 64, 64), 5, ModelConfig(pretrained=str(tmp_path / "shape.pth")))


def test_pretrained_frozen_batchnorm(tmp_path):
    """norm = frozen: the statistics are kept and used in training mode too; the model equals
    the BatchNorm one in eval mode; the small stem (not pretrained) uses GroupNorm."""
    from protofl.models.norms import FrozenBatchNorm2d

    sd = torchvision_resnet18_state(seed=2)
    path = tmp_path / "r18.pth"
    torch.save(sd, path)
    frozen = resnet18((3, 64, 64), 5, ModelConfig(norm="frozen", pretrained=str(path))).double()
    batch = resnet18((3, 64, 64), 5, ModelConfig(norm="batch", pretrained=str(path))).double()
    batch.classifier.load_state_dict(frozen.classifier.state_dict())
    assert torch.equal(frozen.layer4[0].shortcut[1].running_var.float(),
                       sd["layer4.0.downsample.1.running_var"])
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    frozen.train()
    z, _ = frozen(x)
    assert torch.allclose(z, batch.eval()(x)[0], atol=1e-8)
    small = resnet18((3, 28, 28), 5, ModelConfig(norm="frozen", pretrained=str(path)))
    assert isinstance(small.stem[1], torch.nn.GroupNorm)
    assert isinstance(small.layer1[0].norm1, FrozenBatchNorm2d)
    from protofl.models.registry import check_model_config

    with pytest.raises(ProtoflError, match="needs model.pretrained"):
        check_model_config(ModelConfig(name="resnet18", norm="frozen"))
