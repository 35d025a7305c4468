"""The local optimizers by name (one place for the SGD/Adam choice), and the server-side
training loop of the methods whose server trains on the uploaded prototypes."""

from __future__ import annotations

from collections.abc import Callable, Iterable

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


def server_train(weights: dict[str, torch.Tensor],
                 loss: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor],
                 n: int, epochs: int, batch: int, lr: float, gen: torch.Generator,
                 optimizer: str = "sgd") -> tuple[dict[str, torch.Tensor], list[float]]:
    """``epochs`` epochs of mini-batches of ``batch`` of the ``n`` uploaded rows (the order
    drawn from ``gen``), each a step on ``loss(weights, rows)``: plain SGD as one in-place
    update of every tensor (torch.optim.SGD's without momentum, less its per-step overhead),
    else the named optimizer, made afresh. The new weights and each epoch's mean loss."""
    w = {k: v.detach().clone().requires_grad_(True) for k, v in weights.items()}
    params = list(w.values())
    opt = None if optimizer == "sgd" else make_optimizer(params, optimizer, lr)
    history = []
    for _ in range(epochs):
        total = torch.zeros(())
        for idx in torch.randperm(n, generator=gen).split(batch):
            value = loss(w, idx)
            grads = torch.autograd.grad(value, params)
            with torch.no_grad():
                if opt is None:
                    torch._foreach_add_(params, grads, alpha=-lr)
                else:
                    for t, g in zip(params, grads):
                        t.grad = g
                    opt.step()
                total = total + value.detach() * len(idx)
        history.append(float(total) / n)
    return {k: v.detach() for k, v in w.items()}, history
