"""FedNova (Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous
Federated Optimization", NeurIPS 2020): normalized averaging.

Client i takes tau_i local steps of lr eta; its update is ``x - y_i = eta G_i a_i``, a
combination of its gradients whose weights a_i depend on the local solver. The server
averages the *normalized* updates ``d_i = (x - y_i) / ||a_i||_1`` and rescales them by the
effective step count ``tau_eff = sum_i p_i ||a_i||_1`` (p_i = n_i / sum n):

    x <- x - tau_eff sum_i p_i (x - y_i) / ||a_i||_1

so a client taking more steps no longer pulls the model towards its own optimum. The paper
gives ``||a_i||_1``: tau_i for SGD, [tau_i - rho (1 - rho^tau_i) / (1 - rho)] / (1 - rho) with
momentum rho, and [1 - (1 - eta mu)^tau_i] / (eta mu) with a proximal term mu/2 ||y - x||^2.
``solver_norm`` computes it for all three at once as the distance (in units of eta) that
tau_i steps of the client's optimizer move on a loss whose gradient is 1 everywhere, the
proximal pull included: exactly those closed forms when momentum or mu is 0, and their
combination (a reconstruction) when both are set. Weight decay lambda pulls like a proximal
term towards 0, so it adds to mu (also a reconstruction; the paper has no weight decay).
When every tau_i is equal (and so every ||a_i||_1), the rule is FedAvg's.
"""

from __future__ import annotations

import torch

from protofl.algorithms.base import Tensors


def solver_norm(steps: int, lr: float, momentum: float = 0.0, mu: float = 0.0) -> float:
    """``||a||_1`` of ``steps`` steps of SGD (``lr``, heavy-ball ``momentum`` as torch's SGD:
    v <- rho v + g; y <- y - lr v) on a loss whose gradient is 1 plus ``mu`` (y - x): the
    displacement x - y after those steps, divided by ``lr``."""
    e = v = 0.0  # e = y - x
    for _ in range(steps):
        v = momentum * v + 1.0 + mu * e
        e -= lr * v
    return -e / lr if steps else 0.0


def normalized_average(x: Tensors, locals_: list[Tensors], p: torch.Tensor,
                       norms: torch.Tensor) -> tuple[Tensors, float]:
    """FedNova's server rule over the clients' weights ``locals_`` (p: their data shares,
    norms: their ``||a_i||_1``): the new weights and tau_eff."""
    p, norms = p.to(torch.float64), norms.to(torch.float64)
    tau_eff = float((p * norms).sum())
    scale = tau_eff * p / norms  # the weight of each client's update y_i - x
    out = {}
    for k, w in x.items():
        update = sum(s.to(w.dtype) * (y[k] - w) for s, y in zip(scale, locals_))
        out[k] = w + update
    return out, tau_eff
