"""SGD and Adam over stacked per-client parameters (leading dim = client), in place.

Each update matches ``torch.optim.SGD`` (momentum, weight decay; no dampening or Nesterov)
and ``torch.optim.Adam`` (L2 weight decay, bias correction with a per-client step count) step
for step, so the vectorized trainer reproduces the sequential one. The functions mutate the
tensors they are given; pass views (``state.head(n)``, ``p[:n]``) to update a subset of clients
and leave the others exactly as they were.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from protofl.algorithms.optimizers import ADAM_BETAS, ADAM_EPS
from protofl.device import wide
from protofl.engine.train import LocalSetup

Stacked = dict[str, torch.Tensor]


def _head(tensors: Stacked, n: int) -> Stacked:
    return {k: v[:n] for k, v in tensors.items()}


@dataclass
class SgdState:
    """Per-client step counts and (with momentum) momentum buffers."""

    step: torch.Tensor
    momentum: Stacked = field(default_factory=dict)

    def head(self, n: int) -> SgdState:
        return SgdState(self.step[:n], _head(self.momentum, n))


@dataclass
class AdamState:
    """Per-client step counts and first and second moments."""

    step: torch.Tensor
    m: Stacked
    v: Stacked

    def head(self, n: int) -> AdamState:
        return AdamState(self.step[:n], _head(self.m, n), _head(self.v, n))


def init_state(params: Stacked, setup: LocalSetup) -> SgdState | AdamState:
    """Zero optimizer state for stacked ``params`` of ``n`` clients."""
    first = next(iter(params.values()))
    step = torch.zeros(first.shape[0], dtype=wide(first.device), device=first.device)
    if setup.optimizer == "adam":
        return AdamState(step, {k: torch.zeros_like(p) for k, p in params.items()},
                         {k: torch.zeros_like(p) for k, p in params.items()})
    momentum = {k: torch.zeros_like(p) for k, p in params.items()} if setup.momentum else {}
    return SgdState(step, momentum)


def _per_client(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``(n,)`` -> broadcastable against ``like`` (``(n, ...)``) in its dtype."""
    return v.to(like.dtype).reshape(-1, *([1] * (like.dim() - 1)))


def step_(params: Stacked, grads: Stacked, state: SgdState | AdamState,
          setup: LocalSetup) -> None:
    """One optimizer step of every client in the leading dim, in place.

    SGD: ``g += wd p``; ``b = mu b + g`` (``b = g`` at the first step, the same thing from
    ``b = 0``); ``p -= lr b`` (``p -= lr g`` without momentum).
    Adam: ``t += 1``; ``g += wd p``; ``m = b1 m + (1 - b1) g``; ``v = b2 v + (1 - b2) g^2``;
    ``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``.
    """
    state.step += 1
    wd = setup.weight_decay
    if isinstance(state, AdamState):
        beta1, beta2 = ADAM_BETAS
        bc1 = 1 - beta1 ** state.step
        bc2_sqrt = (1 - beta2 ** state.step).sqrt()
        for k, p in params.items():
            g = grads[k] + wd * p if wd else grads[k]
            m, v = state.m[k], state.v[k]
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / _per_client(bc2_sqrt, p)).add_(ADAM_EPS)
            p.sub_(_per_client(setup.lr / bc1, p) * m / denom)
        return
    for k, p in params.items():
        g = grads[k] + wd * p if wd else grads[k]
        if state.momentum:
            buf = state.momentum[k]
            buf.mul_(setup.momentum).add_(g)
            g = buf
        p.add_(g, alpha=-setup.lr)
