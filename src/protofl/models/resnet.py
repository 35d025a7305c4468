"""ResNets (He et al. 2016) as ProtoNets: ``encode`` gives the pooled last-stage feature.

Written here (no torchvision). ResNet-10/18/34 stack BasicBlocks (two 3x3 convolutions;
feature 512), ResNet-50/101/152 Bottlenecks (1x1, strided 3x3, 1x1 to 4x the width, as
torchvision's "v1.5"; feature 2048); the depths are ``DEPTHS``'s (ResNet-10 is HtFLlib's
``resnet10``, [1, 1, 1, 1]). ``cfg.norm`` picks GroupNorm (default; federated training
averages no running statistics), BatchNorm, or the pretrained BatchNorm frozen (``frozen``:
see ``protofl.models.norms``). Inputs smaller than 64 px use a 3x3 stride-1 stem without
max-pooling (the usual CIFAR-style stem); larger ones the 7x7 stride-2 stem and max-pool.
``cfg.pretrained`` loads a local torchvision-style ResNet state_dict (.pth) of the same depth.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from protofl.config import ModelConfig
from protofl.errors import ProtoflError
from protofl.models.nets import ProtoNet
from protofl.models.norms import NORMS, FrozenBatchNorm2d
from protofl.models.pretrained import (
    convert_group_norms,
    read_state_dict,
    source_tensor,
)

log = logging.getLogger("protofl")

SMALL_INPUT = 64  # below this many pixels (shorter side) the small stem is used


def norm_layer(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "frozen":
        return FrozenBatchNorm2d(channels)
    return nn.GroupNorm(min(32, channels), channels)


def _shortcut(c_in: int, c_out: int, stride: int, norm: str) -> nn.Sequential:
    """Identity (an empty Sequential), or a strided 1x1 projection and norm when the shape
    changes."""
    if stride == 1 and c_in == c_out:
        return nn.Sequential()
    return nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), norm_layer(norm, c_out))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (1x1 projection when the shape
    changes); ``c_out`` = ``width``."""

    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int, norm: str):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, width, 3, stride, 1, bias=False)
        self.norm1 = norm_layer(norm, width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.norm2 = norm_layer(norm, width)
        self.relu = nn.ReLU()
        self.shortcut = _shortcut(c_in, width, stride, norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduction to ``width``, strided 3x3, 1x1 expansion to ``4 * width``, with a
    residual connection (1x1 projection when the shape changes)."""

    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int, norm: str):
        super().__init__()
        c_out = width * self.expansion
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.norm1 = norm_layer(norm, width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.norm2 = norm_layer(norm, width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False)
        self.norm3 = norm_layer(norm, c_out)
        self.relu = nn.ReLU()
        self.shortcut = _shortcut(c_in, c_out, stride, norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.relu(self.norm2(self.conv2(out)))
        out = self.norm3(self.conv3(out))
        return self.relu(out + self.shortcut(x))


# depth -> (block, blocks per stage)
DEPTHS: dict[int, tuple[type[nn.Module], tuple[int, int, int, int]]] = {
    10: (BasicBlock, (1, 1, 1, 1)),
    18: (BasicBlock, (2, 2, 2, 2)),
    34: (BasicBlock, (3, 4, 6, 3)),
    50: (Bottleneck, (3, 4, 6, 3)),
    101: (Bottleneck, (3, 4, 23, 3)),
    152: (Bottleneck, (3, 8, 36, 3)),
}


class ResNet(ProtoNet):
    """Stem, four stages of ``DEPTHS[depth]`` blocks (widths 64, 128, 256, 512; the first
    block of stages 2-4 strided), global average pooling (z, d = 512 x the block's
    expansion), linear head."""

    widths = (64, 128, 256, 512)

    def __init__(self, in_shape: tuple[int, ...], num_classes: int, norm: str = "group",
                 depth: int = 18):
        super().__init__()
        if norm not in NORMS:
            raise ProtoflError(f"model.norm = {norm!r}; allowed: {', '.join(NORMS)}")
        if len(in_shape) != 3:
            raise ProtoflError(f"resnet{depth} needs image inputs (C, H, W), got shape "
                               f"{in_shape}")
        block, blocks = DEPTHS[depth]
        self.depth = depth
        c_in, h, w = in_shape
        self.small = min(h, w) < SMALL_INPUT
        if self.small:  # its conv is never pretrained: no statistics to freeze
            self.stem = nn.Sequential(nn.Conv2d(c_in, 64, 3, 1, 1, bias=False),
                                      norm_layer("group" if norm == "frozen" else norm, 64),
                                      nn.ReLU())
        else:
            self.stem = nn.Sequential(nn.Conv2d(c_in, 64, 7, 2, 3, bias=False),
                                      norm_layer(norm, 64), nn.ReLU(),
                                      nn.MaxPool2d(3, 2, 1))
        stages, c = [], 64
        for i, (width, n) in enumerate(zip(self.widths, blocks)):
            layers = []
            for b in range(n):
                layers.append(block(c, width, 2 if i > 0 and b == 0 else 1, norm))
                c = width * block.expansion
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = c
        self.classifier = nn.Linear(c, num_classes)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.pool(x).flatten(1)


class ResNet18(ResNet):
    """ResNet-18: four stages of two BasicBlocks, d = 512."""

    def __init__(self, in_shape: tuple[int, ...], num_classes: int, norm: str = "group"):
        super().__init__(in_shape, num_classes, norm, 18)


def torchvision_key(name: str) -> str | None:
    """The torchvision ResNet key holding our parameter/buffer ``name`` (None: the head)."""
    if name.startswith("classifier."):
        return None
    parts = name.split(".")
    if parts[0] == "stem":
        return {"0": "conv1", "1": "bn1"}[parts[1]] + "." + ".".join(parts[2:])
    if parts[0].startswith("layer"):
        layer, block, mod = parts[0], parts[1], parts[2]
        rest = ".".join(parts[3:])
        if mod in ("conv1", "conv2", "conv3"):
            return f"{layer}.{block}.{mod}.{rest}"
        if mod in ("norm1", "norm2", "norm3"):
            return f"{layer}.{block}.bn{mod[-1]}.{rest}"
        if mod == "shortcut":
            return f"{layer}.{block}.downsample.{rest}"
    raise ValueError(f"no torchvision counterpart for {name!r}")


def load_pretrained(model: ResNet, path: str) -> None:
    """Copy ImageNet weights from a torchvision-style ResNet state_dict of the model's depth
    into ``model``.

    The fc layer is skipped (the head stays freshly initialised). BatchNorm and frozen
    BatchNorm take the weights and running statistics as they are; GroupNorm takes the affine
    of ``protofl.models.norms.group_norm_from_bn``. A 3-channel stem kernel is summed
    over its input channels for 1-channel inputs; the 7x7 stem kernel is not loaded into the
    small 3x3 stem (a warning says so; nor its norm's statistics). Any other missing key or
    shape mismatch is an error.
    """
    source = read_state_dict(path)
    loaded = {}
    for name, value in model.state_dict().items():
        key = torchvision_key(name)
        w = None if key is None else source_tensor(source, key, path, f"ResNet-{model.depth}")
        if w is None:
            continue
        if model.small and key.startswith("bn1."):
            continue  # the statistics of a 7x7 stem do not fit the 3x3 one
        if key == "conv1.weight" and w.shape != value.shape:
            if model.small:
                log.warning("model.pretrained: the 7x7 stem kernel does not fit the small "
                            "3x3 stem; the stem stays randomly initialised")
                continue
            if w.dim() == 4 and value.shape[1] == 1 and w.shape[1] == 3:
                w = w.sum(dim=1, keepdim=True)
        if w.shape != value.shape:
            raise ProtoflError(f"model.pretrained: {key!r} has shape {tuple(w.shape)}, "
                               f"the model needs {tuple(value.shape)}")
        loaded[name] = w.to(value.dtype)
    model.load_state_dict(loaded, strict=False)
    convert_group_norms(model, source, lambda name: None if model.small and name == "stem.1"
                        else torchvision_key(f"{name}.weight").removesuffix(".weight"))


def build(in_shape: tuple[int, ...], num_classes: int, cfg: ModelConfig, depth: int = 18
          ) -> ResNet:
    """ResNet-``depth`` for ``in_shape (C, H, W)`` with ``cfg.norm`` and optional
    ``cfg.pretrained``."""
    model = (ResNet18(tuple(in_shape), num_classes, cfg.norm) if depth == 18
             else ResNet(tuple(in_shape), num_classes, cfg.norm, depth))
    if cfg.pretrained:
        load_pretrained(model, cfg.pretrained)
    return model


def resnet18(in_shape: tuple[int, ...], num_classes: int, cfg: ModelConfig) -> ResNet18:
    """ResNet-18 for ``in_shape (C, H, W)`` with ``cfg.norm`` and optional ``cfg.pretrained``."""
    return build(in_shape, num_classes, cfg, 18)


def resnet10(in_shape: tuple[int, ...], num_classes: int, cfg: ModelConfig) -> ResNet:
    """ResNet-10 (HtFLlib's: one BasicBlock per stage)."""
    return build(in_shape, num_classes, cfg, 10)


def resnet34(in_shape: tuple[int, ...], num_classes: int, cfg: ModelConfig) -> ResNet:
    """ResNet-34: BasicBlocks [3, 4, 6, 3]."""
    return build(in_shape, num_classes, cfg, 34)


def resnet50(in_shape: tuple[int, ...], num_classes: int, cfg: ModelConfig) -> ResNet:
    """ResNet-50: Bottlenecks [3, 4, 6, 3], d = 2048."""
    return build(in_shape, num_classes, cfg, 50)


def resnet101(in_shape: tuple[int, ...], num_classes: int, cfg: ModelConfig) -> ResNet:
    """ResNet-101: Bottlenecks [3, 4, 23, 3], d = 2048."""
    return build(in_shape, num_classes, cfg, 101)


def resnet152(in_shape: tuple[int, ...], num_classes: int, cfg: ModelConfig) -> ResNet:
    """ResNet-152: Bottlenecks [3, 8, 36, 3], d = 2048."""
    return build(in_shape, num_classes, cfg, 152)
