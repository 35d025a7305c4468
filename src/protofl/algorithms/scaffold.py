"""SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning", ICML 2020, Algorithm 1): control variates correct the clients' drift.

The server keeps x and the control variate c, client i its own c_i (0 at first). Client i
starts from y_i = x and takes K steps ``y_i <- y_i - eta_l (g_i(y_i) - c_i + c)``: its loss
gets the term <c - c_i, y>, whose gradient is the correction. Then

    c_i+ = g_i(x)                                          (option I: a pass over its data)
    c_i+ = c_i - c + (x - y_i) / (K eta_l)                 (option II, the default)

and it uploads y_i and Delta c_i = c_i+ - c_i, keeping c_i+. Over the round's clients S of
the N in the federation, the server takes plain means (the paper's, not weighted by n_i)

    x <- x + eta_g mean_S (y_i - x)        c <- c + |S| / N mean_S Delta c_i

With momentum or weight decay, option II's K becomes FedNova's ||a||_1 of the client's
solver (``fednova.solver_norm``: K for plain SGD), so (x - y_i) / (||a||_1 eta_l) is still
the mean corrected gradient the client followed (a reconstruction; the paper's analysis
uses plain SGD).
"""

from __future__ import annotations

import torch

from protofl.algorithms.base import Tensors


def control_option2(c_i: Tensors, c: Tensors, x: Tensors, y: Tensors, norm: float,
                    lr: float) -> Tensors:
    """Option II: ``c_i+ = c_i - c + (x - y) / (norm lr)`` (norm: K, or ||a||_1)."""
    return {k: c_i[k] - c[k] + (x[k] - y[k]) / (norm * lr) for k in c_i}


def server_step(x: Tensors, c: Tensors, locals_: list[Tensors], deltas: list[Tensors],
                eta_g: float, num_clients: int) -> tuple[Tensors, Tensors]:
    """The server's update from the round's client weights ``locals_`` and control-variate
    changes ``deltas``: ``x + eta_g mean(y_i - x)``, ``c + |S|/N mean(Delta c_i)``."""
    s = len(locals_)
    new_x = {k: w + eta_g * sum(y[k] - w for y in locals_) / s for k, w in x.items()}
    new_c = {k: v + sum(d[k] for d in deltas) / num_clients for k, v in c.items()}
    return new_x, new_c


def zeros_like(tree: Tensors) -> Tensors:
    return {k: torch.zeros_like(v) for k, v in tree.items()}
