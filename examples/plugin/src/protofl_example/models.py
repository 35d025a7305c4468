"""A residual MLP for vector data: ``x -> h`` then two blocks ``h + f(h)``; ``z = h``."""

from __future__ import annotations

import math

import torch
from protofl import ProtoNet
from torch import nn


class ResidualMlp(ProtoNet):
    """``Linear(in, width)``, ReLU, then ``blocks`` residual blocks of two linear layers."""

    def __init__(self, in_dim: int, num_classes: int, width: int = 64, blocks: int = 2):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(in_dim, width), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
            for _ in range(blocks))
        self.feature_dim = width
        self.classifier = nn.Linear(width, num_classes)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x.flatten(1))
        for block in self.blocks:
            h = torch.relu(h + block(h))
        return h


def residual_mlp(in_shape: tuple[int, ...], num_classes: int) -> ResidualMlp:
    """protofl's model factory: any input shape, flattened."""
    return ResidualMlp(math.prod(in_shape), num_classes)
