"""The seed papers' small models. Each has ``encode(x) -> z`` and ``head(z) -> logits``;
``forward(x)`` returns both ``(z, logits)`` so one functional call serves every loss."""

from __future__ import annotations

import torch
from torch import nn

from protofl.errors import ProtoflError


class ProtoNet(nn.Module):
    """Base: an encoder (features before the classifier) and a linear head."""

    feature_dim: int

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return self.classifier(z)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.encode(x)
        return z, self.head(z)


class Beside(ProtoNet):
    """A client's own model (``backbone``: what it is scored with, its ``(z, logits)``) with
    an algorithm's extra modules beside it (fml's meme, fedkd's mentee, fedmrl's small
    model)."""

    def __init__(self, backbone: ProtoNet):
        super().__init__()
        self.backbone = backbone
        self.feature_dim = backbone.feature_dim

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone.encode(x)

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return self.backbone.head(z)


class Mlp(ProtoNet):
    """60 -> 128 -> 256 -> C (the seed's Synthetic model); z is the 256-d hidden layer."""

    def __init__(self, in_dim: int, num_classes: int, hidden: tuple[int, ...] = (128, 256)):
        super().__init__()
        layers, d = [], in_dim
        for h in hidden:
            layers += [nn.Linear(d, h), nn.ReLU()]
            d = h
        self.body = nn.Sequential(*layers)
        self.feature_dim = d
        self.classifier = nn.Linear(d, num_classes)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x.flatten(1))


class ConvNet(ProtoNet):
    """Conv blocks, then hidden fully connected layers (the last one's output is the feature
    z), then the head."""

    def __init__(self, in_shape: tuple[int, ...], num_classes: int, channels: tuple[int, ...],
                 kernel: int, fc: int | tuple[int, ...] | None, pool_then_relu: bool = False,
                 padding: int | None = None):
        super().__init__()
        blocks, c = [], in_shape[0]
        pad = kernel // 2 if padding is None else padding  # default: "same" size
        for ch in channels:
            conv = nn.Conv2d(c, ch, kernel, padding=pad)
            blocks += [conv, nn.MaxPool2d(2), nn.ReLU()] if pool_then_relu else [
                conv, nn.ReLU(), nn.MaxPool2d(2)]
            c = ch
        self.features = nn.Sequential(*blocks, nn.Flatten())
        with torch.no_grad():
            flat = self.features(torch.zeros(1, *in_shape)).shape[1]
        widths = (fc,) if isinstance(fc, int) else tuple(fc or ())
        layers, d = [], flat
        for width in widths:
            layers += [nn.Linear(d, width), nn.ReLU()]
            d = width
        self.fc = nn.Sequential(*layers) if layers else nn.Identity()
        self.feature_dim = d
        self.classifier = nn.Linear(self.feature_dim, num_classes)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


def leaf_cnn(in_shape, num_classes):
    """conv5x5(32) pool, conv5x5(64) pool, fc 256 (MNIST, FEMNIST)."""
    return ConvNet(in_shape, num_classes, (32, 64), 5, 256)


def lenet5(in_shape, num_classes):
    """The LeNet-5-style CNN of FL benchmarks (NIID-Bench's simple CNN, Li et al. 2022):
    conv5x5(6) ReLU pool, conv5x5(16) ReLU pool, both unpadded, fc 120, fc 84 (the feature z);
    44,426 parameters on 28x28 grey images with 10 classes, 62,006 on 32x32 RGB."""
    _two_unpadded_convs("lenet5", in_shape)
    return ConvNet(in_shape, num_classes, (6, 16), 5, (120, 84), padding=0)


def digits_cnn(in_shape, num_classes):
    """The same design scaled to 8x8 digits: conv3x3(32) pool, conv3x3(64) pool, fc 128."""
    return ConvNet(in_shape, num_classes, (32, 64), 3, 128)


def celeba_cnn(in_shape, num_classes):
    """4 x (conv3x3 32, pool, ReLU), flattened features, then the head (CelebA)."""
    return ConvNet(in_shape, num_classes, (32, 32, 32, 32), 3, None, pool_then_relu=True)


def fedavg_cnn(in_shape, num_classes):
    """HtFLlib's ``FedAvgCNN`` (McMahan et al.'s CIFAR CNN): conv5x5(32) ReLU pool,
    conv5x5(64) ReLU pool, both unpadded, fc 512 (the feature z); the flattened size follows
    from the input (1600 at 32x32, HtFLlib's ``dim=1600``)."""
    _two_unpadded_convs("fedavg_cnn", in_shape)
    return ConvNet(in_shape, num_classes, (32, 64), 5, 512, padding=0)


def _two_unpadded_convs(name: str, in_shape) -> None:
    """One line unless ``in_shape`` is an image (C, H, W) that two unpadded 5x5 convs, each
    pooled by 2, leave at least one pixel of."""
    side = min(in_shape[1:]) if len(in_shape) == 3 else 0
    if len(in_shape) != 3 or (((side - 4) // 2) - 4) // 2 < 1:
        raise ProtoflError(f"{name} needs image inputs (C, H, W) of at least 14 px (two "
                           f"unpadded 5x5 convs, each pooled), got shape {tuple(in_shape)}")
