"""SGD and Adam over stacked per-client parameters (leading dim = client), in place.

Each update matches ``torch.optim.SGD`` (momentum, weight decay; no dampening or Nesterov)
and ``torch.optim.Adam`` (L2 weight decay, bias correction with a per-client step count) step
for step, so the vectorized trainer reproduces the sequential one. The functions mutate the
tensors they are given; pass views (``state.part(...)``, ``p[:n]``) to update a subset of
clients and leave the others exactly as they were, or an ``active`` mask (a compiled step of
fixed shape) to update only the clients it marks. The new values are computed with one
``torch._foreach_*`` call per operation over every tensor, then written back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from protofl.algorithms.optimizers import ADAM_BETAS, ADAM_EPS
from protofl.device import wide
from protofl.engine.train import LocalSetup

Stacked = dict[str, torch.Tensor]


def _part(tensors: Stacked, rows: slice) -> Stacked:
    return {k: v[rows] for k, v in tensors.items()}


@dataclass
class SgdState:
    """Per-client step counts and (with momentum) momentum buffers."""

    step: torch.Tensor
    momentum: Stacked = field(default_factory=dict)

    def part(self, rows: slice) -> SgdState:
        return SgdState(self.step[rows], _part(self.momentum, rows))


@dataclass
class AdamState:
    """Per-client step counts and first and second moments."""

    step: torch.Tensor
    m: Stacked
    v: Stacked

    def part(self, rows: slice) -> AdamState:
        return AdamState(self.step[rows], _part(self.m, rows), _part(self.v, rows))


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


def _commit(dst: list[torch.Tensor], new: list[torch.Tensor],
            active: torch.Tensor | None) -> None:
    """``dst = new``, or only for the clients ``active`` marks."""
    if active is None:
        torch._foreach_copy_(dst, new)
        return
    for d, v in zip(dst, new):
        d.copy_(torch.where(active.reshape(-1, *([1] * (d.dim() - 1))), v, d))


def step_(params: Stacked, grads: Stacked, state: SgdState | AdamState,
          setup: LocalSetup, active: torch.Tensor | None = None) -> None:
    """One optimizer step of every client in the leading dim (or of those ``active``, a
    ``(n,)`` bool mask, marks), in place.

    SGD: ``g += wd p``; ``b = mu b + g`` (``b = g`` at the first step, the same thing from
    ``b = 0``); ``p -= lr b`` (``p -= lr g`` without momentum).
    Adam: ``t += 1``; ``g += wd p``; ``m = b1 m + (1 - b1) g``; ``v = b2 v + (1 - b2) g^2``;
    ``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``.
    """
    keys = list(params)
    p = [params[k] for k in keys]
    g = [grads[k] for k in keys]
    state.step += 1 if active is None else active.to(state.step.dtype)
    if setup.weight_decay:
        g = torch._foreach_add(g, torch._foreach_mul(p, setup.weight_decay))
    if isinstance(state, AdamState):
        beta1, beta2 = ADAM_BETAS
        m = [state.m[k] for k in keys]
        v = [state.v[k] for k in keys]
        m_new = torch._foreach_lerp(m, g, 1 - beta1)
        v_new = torch._foreach_addcmul(torch._foreach_mul(v, beta2), g, g, value=1 - beta2)
        bc1 = 1 - beta1 ** state.step
        bc2_sqrt = (1 - beta2 ** state.step).sqrt()
        p_new = [pi - _per_client(setup.lr / bc1, pi) * mi
                 / (vi.sqrt() / _per_client(bc2_sqrt, pi)).add_(ADAM_EPS)
                 for pi, mi, vi in zip(p, m_new, v_new)]
        _commit(m + v + p, [*m_new, *v_new, *p_new], active)
        return
    if state.momentum:
        b = [state.momentum[k] for k in keys]
        g = torch._foreach_add(torch._foreach_mul(b, setup.momentum), g)
        _commit(b, g, active)
    _commit(p, torch._foreach_add(p, g, alpha=-setup.lr), active)
