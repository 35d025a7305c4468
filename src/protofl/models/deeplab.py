"""DeepLab-V3+ (Chen et al. 2018) with a MobileNetV2 encoder (Sandler et al. 2018), as a
ProtoNet for semantic segmentation. Written here; no torchvision.

- Encoder: MobileNetV2's inverted residual stages with a width multiplier; the last stages
  trade stride for dilation so the high-level map has output stride 8 or 16. Low-level
  features are taken at stride 4.
- ASPP: a 1x1 branch, three 3x3 atrous branches and an image-pooling branch, projected 1x1.
- Decoder: the ASPP output upsampled to stride 4, joined with the reduced low-level features,
  two 3x3 convolutions: this map is ``z = encode(x)``, ``(B, d, H/4, W/4)``, ``d =
  channels``; the pixel features prototypes are computed from.
- ``head(z)``: a 1x1 classifier, then bilinear upsampling to the input size.

GroupNorm by default (no running statistics, so ``torch.func.vmap`` over clients applies);
BatchNorm, or the pretrained encoder's BatchNorm frozen (``norm = "frozen"``, see
``protofl.models.norms``), as options. No Dropout. ``load_pretrained`` maps a
torchvision-style ``mobilenet_v2`` state_dict onto the encoder (its module names follow the
same layout).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from protofl.errors import ProtoflError
from protofl.models.nets import ProtoNet
from protofl.models.norms import NORMS, FrozenBatchNorm2d
from protofl.models.pretrained import (
    convert_group_norms,
    read_state_dict,
    source_tensor,
)

OUTPUT_STRIDES = (8, 16)
# the defaults of width multiplier, output stride and ASPP/decoder channels (model.width,
# model.output_stride, model.seg_channels)
DEFAULTS = {"width": 1.0, "output_stride": 16, "channels": 256}
# (expansion t, channels c, repeats n, first stride s) of MobileNetV2's bottleneck stages
STAGES = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
          (6, 160, 3, 2), (6, 320, 1, 1))
LOW_LEVEL_BLOCKS = 4  # features[:4] ends at stride 4 (the 24-channel stage)
RATES = {16: (6, 12, 18), 8: (12, 24, 36)}


def divisible(v: float, by: int = 8) -> int:
    """``v`` rounded to the nearest multiple of ``by`` (at least ``by``), never below 90% of
    ``v`` (MobileNet's channel rounding for width multipliers)."""
    out = max(by, int(v + by / 2) // by * by)
    return out + by if out < 0.9 * v else out


def norm_layer(kind: str, channels: int) -> nn.Module:
    """BatchNorm, frozen BatchNorm, or GroupNorm with ``gcd(32, channels)`` groups, halved
    until each group holds at least 4 channels (one channel per group would be instance norm,
    which wipes out each image's per-channel level, colour included)."""
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "frozen":
        return FrozenBatchNorm2d(channels)
    groups = math.gcd(32, channels)
    while groups > 1 and channels // groups < 4:
        groups //= 2
    return nn.GroupNorm(groups, channels)


class ConvNormAct(nn.Sequential):
    """Conv (no bias), norm, activation; submodules ``0``, ``1``, ``2`` (torchvision's
    layout, so pretrained keys line up)."""

    def __init__(self, c_in: int, c_out: int, kernel: int, norm: str, stride: int = 1,
                 dilation: int = 1, groups: int = 1, act: type[nn.Module] = nn.ReLU6):
        pad = dilation * (kernel - 1) // 2
        super().__init__(nn.Conv2d(c_in, c_out, kernel, stride, pad, dilation, groups,
                                   bias=False),
                         norm_layer(norm, c_out), act())


class InvertedResidual(nn.Module):
    """1x1 expansion (skipped when t = 1), 3x3 depthwise (strided or dilated), linear 1x1
    projection; identity shortcut when the shape is kept."""

    def __init__(self, c_in: int, c_out: int, stride: int, expand: int, dilation: int,
                 norm: str):
        super().__init__()
        hidden = int(round(c_in * expand))
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(ConvNormAct(c_in, hidden, 1, norm))
        layers += [ConvNormAct(hidden, hidden, 3, norm, stride, dilation, groups=hidden),
                   nn.Conv2d(hidden, c_out, 1, bias=False), norm_layer(norm, c_out)]
        self.conv = nn.Sequential(*layers)
        self.shortcut = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        return x + out if self.shortcut else out


class MobileNetV2Encoder(nn.Module):
    """The stem and the 17 bottleneck blocks (``features.0`` .. ``features.17``); the final
    1x1 to 1280 channels of the classifier network is not used by DeepLab."""

    def __init__(self, in_channels: int, width: float, output_stride: int, norm: str):
        super().__init__()
        c = divisible(32 * width)
        blocks: list[nn.Module] = [ConvNormAct(in_channels, c, 3, norm, stride=2)]
        stride, dilation = 2, 1
        for t, ch, n, s in STAGES:
            c_out = divisible(ch * width)
            first_dilation = dilation  # a block that would pass the output stride keeps
            if stride * s > output_stride:  # the resolution; the blocks after it dilate
                dilation *= s
                s = 1
            else:
                stride *= s
            for i in range(n):
                blocks.append(InvertedResidual(c, c_out, s if i == 0 else 1, t,
                                               first_dilation if i == 0 else dilation, norm))
                c = c_out
        self.features = nn.Sequential(*blocks)
        self.low_channels = divisible(24 * width)
        self.high_channels = c

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(low-level features at stride 4, high-level features at the output stride)."""
        low = self.features[:LOW_LEVEL_BLOCKS](x)
        return low, self.features[LOW_LEVEL_BLOCKS:](low)


class ASPP(nn.Module):
    """Atrous spatial pyramid pooling: parallel 1x1, dilated 3x3 and image-pooling branches,
    concatenated and projected to ``channels``."""

    def __init__(self, c_in: int, channels: int, rates: tuple[int, ...], norm: str):
        super().__init__()
        self.branches = nn.ModuleList(
            [ConvNormAct(c_in, channels, 1, norm, act=nn.ReLU)]
            + [ConvNormAct(c_in, channels, 3, norm, dilation=r, act=nn.ReLU) for r in rates])
        self.pooled = ConvNormAct(c_in, channels, 1, norm, act=nn.ReLU)
        self.project = ConvNormAct(channels * (len(rates) + 2), channels, 1, norm, act=nn.ReLU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [b(x) for b in self.branches]
        g = self.pooled(x.mean(dim=(2, 3), keepdim=True))
        outs.append(g.expand(-1, -1, x.shape[-2], x.shape[-1]))
        return self.project(torch.cat(outs, 1))


class DeepLabV3Plus(ProtoNet):
    """DeepLab-V3+ / MobileNetV2; ``encode(x)`` -> ``(B, d, H/4, W/4)`` pixel features,
    ``head(z)`` -> ``(B, num_classes, H, W)`` logits (see the module docstring). ``head``
    upsamples to the ``(H, W)`` of ``in_shape``, so inputs must have that size."""

    def __init__(self, in_shape: tuple[int, ...], num_classes: int,
                 width: float = DEFAULTS["width"],
                 output_stride: int = DEFAULTS["output_stride"],
                 channels: int = DEFAULTS["channels"], norm: str = "group",
                 rates: tuple[int, ...] | None = None, skip_channels: int | None = None):
        super().__init__()
        if len(in_shape) != 3:
            raise ProtoflError(f"deeplabv3plus needs image inputs (C, H, W), got {in_shape}")
        if norm not in NORMS:
            raise ProtoflError(f"model.norm = {norm!r}; allowed: {', '.join(NORMS)}")
        if output_stride not in OUTPUT_STRIDES:
            raise ProtoflError(f"deeplabv3plus output stride {output_stride!r}; allowed: 8, 16")
        if not 0 < width <= 4:
            raise ProtoflError(f"deeplabv3plus width multiplier {width!r}; allowed: (0, 4]")
        if channels < 8 or channels % 8:
            raise ProtoflError(f"deeplabv3plus channels {channels!r}; allowed: a multiple "
                               "of 8, >= 8")
        self.input_size = (int(in_shape[1]), int(in_shape[2]))
        self.encoder = MobileNetV2Encoder(in_shape[0], width, output_stride, norm)
        head = "group" if norm == "frozen" else norm  # no pretrained statistics there
        self.aspp = ASPP(self.encoder.high_channels, channels,
                         tuple(rates or RATES[output_stride]), head)
        skip = skip_channels or divisible(48 * channels / 256)
        self.reduce = ConvNormAct(self.encoder.low_channels, skip, 1, head, act=nn.ReLU)
        self.fuse = nn.Sequential(ConvNormAct(channels + skip, channels, 3, head, act=nn.ReLU),
                                  ConvNormAct(channels, channels, 3, head, act=nn.ReLU))
        self.classifier = nn.Conv2d(channels, num_classes, 1)
        self.feature_dim = channels

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        low, high = self.encoder(x)
        a = F.interpolate(self.aspp(high), size=low.shape[-2:], mode="bilinear",
                          align_corners=False)
        return self.fuse(torch.cat([a, self.reduce(low)], 1))

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return F.interpolate(self.classifier(z), size=self.input_size, mode="bilinear",
                             align_corners=False)


def load_pretrained(model: DeepLabV3Plus, path: str | Path) -> int:
    """Copy a torchvision-style ``mobilenet_v2`` state_dict (``features.N....``) into the
    encoder; returns the number of tensors loaded.

    ``features.18`` and ``classifier`` of the source are unused. BatchNorm and frozen
    BatchNorm take the weights and running statistics as they are; GroupNorm takes the
    affine of ``protofl.models.norms.group_norm_from_bn`` (the running statistics carried
    into it). A 3-channel stem kernel is summed
    over its input channels for 1-channel inputs. A missing key or a shape mismatch (e.g. a
    different width multiplier) is an error naming the key.
    """
    source = read_state_dict(path)
    loaded = {}
    for name, value in model.encoder.state_dict().items():
        w = source_tensor(source, name, path, "MobileNetV2")
        if w is None:
            continue
        if name == "features.0.0.weight" and value.shape[1] == 1 and w.dim() == 4 and (
                w.shape[1] == 3):
            w = w.sum(dim=1, keepdim=True)
        if w.shape != value.shape:
            raise ProtoflError(f"model.pretrained: {name!r} has shape {tuple(w.shape)}, the "
                               f"model needs {tuple(value.shape)} (another width multiplier?)")
        loaded[name] = w.to(value.dtype)
    model.encoder.load_state_dict(loaded, strict=False)
    convert_group_norms(model.encoder, source, lambda name: name)
    return len(loaded)


def deeplabv3plus(in_shape: tuple[int, ...], num_classes: int, cfg=None, *,
                  width: float | None = None, output_stride: int | None = None,
                  channels: int | None = None) -> DeepLabV3Plus:
    """Registry builder. Options come from the keyword arguments, else from ``cfg``'s
    ``width``, ``output_stride`` and ``seg_channels`` attributes when it has them, else
    ``DEFAULTS``; ``cfg.norm`` and ``cfg.pretrained`` are used as for ResNet-18."""
    def pick(value, attr, key):
        return value if value is not None else getattr(cfg, attr, None) or DEFAULTS[key]

    model = DeepLabV3Plus(tuple(in_shape), num_classes, width=pick(width, "width", "width"),
                          output_stride=pick(output_stride, "output_stride", "output_stride"),
                          channels=pick(channels, "seg_channels", "channels"),
                          norm=getattr(cfg, "norm", None) or "group")
    if getattr(cfg, "pretrained", None):
        load_pretrained(model, cfg.pretrained)
    return model
