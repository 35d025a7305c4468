"""The local optimizers by name (one place for the SGD/Adam choice)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

OPTIMIZERS = ("sgd", "adam")
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # torch.optim.Adam's defaults


def make_optimizer(params: Iterable[torch.Tensor], name: str, lr: float, momentum: float = 0.0,
                   weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """``torch.optim.Adam`` (L2 weight decay) or ``torch.optim.SGD`` (momentum, weight decay)."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS,
                                weight_decay=weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
