"""GoogLeNet (Inception v1; Szegedy et al., CVPR 2015) as a ProtoNet: ``encode`` gives the
1024-d globally pooled output of the last inception module.

Written here (no torchvision), in the layout torchvision's ``googlenet`` builds and HtFLlib's
HtFE-img-4/5/8 use (``aux_logits=False``: no auxiliary heads): a stem (7x7 stride-2 conv,
max-pool, 1x1 and 3x3 convs, max-pool), inception 3a-3b, max-pool, 4a-4e, max-pool, 5a-5b,
global average pooling. As in torchvision, the paper's 5x5 branch is a 3x3 convolution and
there is no local response normalisation; HtFLlib's dropout before the head is left out
(the vectorized trainer draws no dropout masks). Every conv is bias-free and followed by
``cfg.norm`` (GroupNorm by default, as DeepLab's ``norm_layer``) and ReLU. Inputs smaller
than 64 px use a 3x3 stride-1 first conv and no first max-pool (ResNet's small-input rule).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from protofl.config import ModelConfig
from protofl.errors import ProtoflError
from protofl.models.deeplab import ConvNormAct
from protofl.models.nets import ProtoNet
from protofl.models.norms import NORMS
from protofl.models.resnet import SMALL_INPUT

# name -> (1x1, 3x3 reduce, 3x3, "5x5" reduce, "5x5" (a 3x3 conv), pool projection)
INCEPTIONS: dict[str, tuple[int, int, int, int, int, int]] = {
    "3a": (64, 96, 128, 16, 32, 32),
    "3b": (128, 128, 192, 32, 96, 64),
    "4a": (192, 96, 208, 16, 48, 64),
    "4b": (160, 112, 224, 24, 64, 64),
    "4c": (128, 128, 256, 24, 64, 64),
    "4d": (112, 144, 288, 32, 64, 64),
    "4e": (256, 160, 320, 32, 128, 128),
    "5a": (256, 160, 320, 32, 128, 128),
    "5b": (384, 192, 384, 48, 128, 128),
}
POOL_AFTER = {"3b": ("pool3", 3), "4e": ("pool4", 2)}  # the max-pools between stages, kernel


def _conv(c_in: int, c_out: int, kernel: int, norm: str, stride: int = 1) -> ConvNormAct:
    return ConvNormAct(c_in, c_out, kernel, norm, stride, act=nn.ReLU)


class Inception(nn.Module):
    """Four parallel branches (1x1; 1x1-3x3; 1x1-3x3; 3x3 max-pool-1x1), concatenated."""

    def __init__(self, c_in: int, widths: tuple[int, int, int, int, int, int], norm: str):
        super().__init__()
        c1, r3, c3, r5, c5, cp = widths
        self.branch1 = _conv(c_in, c1, 1, norm)
        self.branch2 = nn.Sequential(_conv(c_in, r3, 1, norm), _conv(r3, c3, 3, norm))
        self.branch3 = nn.Sequential(_conv(c_in, r5, 1, norm), _conv(r5, c5, 3, norm))
        self.branch4 = nn.Sequential(nn.MaxPool2d(3, 1, 1, ceil_mode=True),
                                     _conv(c_in, cp, 1, norm))
        self.out_channels = c1 + c3 + c5 + cp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch1(x), self.branch2(x), self.branch3(x), self.branch4(x)],
                         dim=1)


class GoogLeNet(ProtoNet):
    """The stem, nine inception modules, global average pooling (z, d = 1024), linear head."""

    def __init__(self, in_shape: tuple[int, ...], num_classes: int, norm: str = "group"):
        super().__init__()
        if norm not in NORMS:
            raise ProtoflError(f"model.norm = {norm!r}; allowed: {', '.join(NORMS)}")
        if len(in_shape) != 3:
            raise ProtoflError(f"googlenet needs image inputs (C, H, W), got shape {in_shape}")
        c_in, h, w = in_shape
        self.small = min(h, w) < SMALL_INPUT
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        if self.small:
            layers["conv1"] = _conv(c_in, 64, 3, norm)
        else:
            layers["conv1"] = _conv(c_in, 64, 7, norm, stride=2)
            layers["pool1"] = nn.MaxPool2d(3, 2, ceil_mode=True)
        layers["conv2"] = _conv(64, 64, 1, norm)
        layers["conv3"] = _conv(64, 192, 3, norm)
        layers["pool2"] = nn.MaxPool2d(3, 2, ceil_mode=True)
        c = 192
        for name, widths in INCEPTIONS.items():
            block = Inception(c, widths, norm)
            layers[f"inception{name}"] = block
            c = block.out_channels
            if name in POOL_AFTER:
                pool, kernel = POOL_AFTER[name]
                layers[pool] = nn.MaxPool2d(kernel, 2, ceil_mode=True)
        self.features = nn.Sequential(layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = c
        self.classifier = nn.Linear(c, num_classes)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.features(x)).flatten(1)


def googlenet(in_shape: tuple[int, ...], num_classes: int, cfg: ModelConfig) -> GoogLeNet:
    """GoogLeNet for ``in_shape (C, H, W)`` with ``cfg.norm``."""
    return GoogLeNet(tuple(in_shape), num_classes, cfg.norm)
