"""SGD and Adam over stacked per-client parameters (leading dim = client), in place.

Each update matches ``torch.optim.SGD`` (momentum, weight decay; no dampening or Nesterov)
and ``torch.optim.Adam`` (L2 weight decay, bias correction with a per-client step count) step
for step, so the vectorized trainer reproduces the sequential one. The functions mutate the
tensors they are given; pass views (e.g. ``p[:n]``) to update a subset of clients and leave the
others exactly as they were.
"""

from __future__ import annotations

import torch

from protofl.engine.train import LocalSetup

BETA1, BETA2, EPS = 0.9, 0.999, 1e-8  # torch.optim.Adam's defaults, which train.py uses


def init_state(params: dict[str, torch.Tensor], s: LocalSetup) -> dict[str, torch.Tensor]:
    """Zero optimizer state for stacked ``params`` of ``n`` clients: momentum buffers (SGD with
    momentum), first and second moments (Adam), and the per-client step count ``step``."""
    n = next(iter(params.values())).shape[0]
    state: dict[str, torch.Tensor] = {"step": torch.zeros(n, dtype=torch.float64)}
    if s.optimizer == "adam":
        for k, p in params.items():
            state[f"m.{k}"] = torch.zeros_like(p)
            state[f"v.{k}"] = torch.zeros_like(p)
    elif s.momentum:
        for k, p in params.items():
            state[f"buf.{k}"] = torch.zeros_like(p)
    return state


def _per_client(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``(n,)`` -> broadcastable against ``like`` (``(n, ...)``) in its dtype."""
    return v.to(like.dtype).reshape(-1, *([1] * (like.dim() - 1)))


def step_(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
          state: dict[str, torch.Tensor], s: LocalSetup) -> None:
    """One optimizer step of every client in the leading dim, in place.

    SGD: ``g += wd p``; ``b = mu b + g`` (``b = g`` at the first step, the same thing from
    ``b = 0``); ``p -= lr b`` (``p -= lr g`` without momentum).
    Adam: ``t += 1``; ``g += wd p``; ``m = b1 m + (1 - b1) g``; ``v = b2 v + (1 - b2) g^2``;
    ``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``.
    """
    state["step"] += 1
    wd = s.weight_decay
    if s.optimizer == "adam":
        t = state["step"]
        bc1 = 1 - BETA1 ** t
        bc2_sqrt = (1 - BETA2 ** t).sqrt()
        for k, p in params.items():
            g = grads[k] + wd * p if wd else grads[k]
            m, v = state[f"m.{k}"], state[f"v.{k}"]
            m.lerp_(g, 1 - BETA1)
            v.mul_(BETA2).addcmul_(g, g, value=1 - BETA2)
            denom = (v.sqrt() / _per_client(bc2_sqrt, p)).add_(EPS)
            p.sub_(_per_client(s.lr / bc1, p) * m / denom)
        return
    for k, p in params.items():
        g = grads[k] + wd * p if wd else grads[k]
        if s.momentum:
            buf = state[f"buf.{k}"]
            buf.mul_(s.momentum).add_(g)
            g = buf
        p.add_(g, alpha=-s.lr)
