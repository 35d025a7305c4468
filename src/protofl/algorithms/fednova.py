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
With Adam, ``||a_i||_1 = tau_i`` (``client_norm``). When every tau_i is equal (and so every
||a_i||_1), the rule is FedAvg's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protofl.algorithms.base import (
    Algorithm,
    Tensors,
    UploadEntry,
    sample_weights,
    weighted_average,
)
from protofl.algorithms.contract import ClientRound, TrainedClient
from protofl.algorithms.fedavg import proximal_term
from protofl.config import TASKS, option


def solver_norm(steps: int, lr: float, momentum: float = 0.0, mu: float = 0.0) -> float:
    """``||a||_1`` of ``steps`` steps of SGD (``lr``, heavy-ball ``momentum`` as torch's SGD:
    v <- rho v + g; y <- y - lr v) on a loss whose gradient is 1 plus ``mu`` (y - x): the
    displacement x - y after those steps, divided by ``lr``."""
    e = v = 0.0  # e = y - x
    for _ in range(steps):
        v = momentum * v + 1.0 + mu * e
        e -= lr * v
    return -e / lr if steps else 0.0


def client_norm(c: ClientRound, mu: float = 0.0) -> float:
    """``||a||_1`` of client ``c``'s round: ``solver_norm`` of its SGD steps (weight decay
    added to ``mu``); with Adam its step count, as each Adam step applies one unit of its
    bias-corrected first moment, whose weights on past gradients sum to 1 (a
    reconstruction: the paper gives a_i for SGD only)."""
    if c.optimizer == "adam":
        return float(c.steps)
    return solver_norm(c.steps, c.lr, c.momentum, mu + c.weight_decay)


def normalized_average(x: Tensors, locals_: list[Tensors], p: torch.Tensor,
                       norms: torch.Tensor) -> tuple[Tensors, float]:
    """FedNova's server rule over the clients' weights ``locals_`` (p: their data shares,
    norms: their ``||a_i||_1``): the new weights and tau_eff."""
    p, norms = p.to(torch.float64), norms.to(torch.float64)
    tau_eff = float((p * norms).sum())
    # the weight of each client's update y_i - x (a client that took no step moved nowhere)
    scale = torch.where(norms > 0, tau_eff * p / norms.clamp_min(1e-300), 0.0)
    out = {}
    for k, w in x.items():
        update = sum(s.to(w.dtype) * (y[k] - w) for s, y in zip(scale, locals_))
        out[k] = w + update
    return out, tau_eff


@dataclass
class NovaOptions:
    mu: float = option(0.0, "proximal term mu/2 ||W - W^t||^2 of the local loss (FedProx's; "
                       "0: none)", ge=0)


class FedNova(Algorithm):
    name = "fednova"
    description = ("FedNova (Wang et al.): x -= tau_eff sum p_i (x - y_i) / ||a_i||_1, each "
                   "update normalized by its local solver's steps")
    Options = NovaOptions
    client_defaults = {"tolerate_partial": True}
    client_defaults_source = ("Wang et al. 2020: clients' unequal local work (steps) is what "
                              "FedNova normalizes, so stragglers' partial work is aggregated")
    tasks = TASKS
    individual_reason = ("its server divides each client's update by that client's own "
                         "||a_i||_1 (its local solver's steps)")

    def client_begin(self, c: ClientRound):
        return {"anchor": c.broadcast["params"]} if self.opts.mu > 0 else {}

    def loss(self, model, params, buffers, x, y, w, ctx):
        loss = super().loss(model, params, buffers, x, y, w, ctx)
        if self.opts.mu > 0:
            loss = loss + 0.5 * self.opts.mu * proximal_term(params, ctx["anchor"])
        return loss

    def client_end(self, t: TrainedClient):
        upload, state = super().client_end(t)
        upload["norm"] = torch.tensor(client_norm(t, self.opts.mu), dtype=torch.float64)
        return upload, state

    def upload_spec(self):
        return {**super().upload_spec(), "norm": UploadEntry((), count=True)}

    def aggregate(self, state, uploads, round):
        p = sample_weights(uploads)
        norms = torch.stack([u["norm"] for u in uploads]).to(p.device)
        params, tau_eff = normalized_average(state["params"], [u["params"] for u in uploads],
                                             p, norms)
        buffers = weighted_average([u["buffers"] for u in uploads], p) if (
            uploads[0].get("buffers")) else {}
        return {**state, "params": params, "buffers": buffers}, {
            "weights": p.tolist(), "tau_eff": tau_eff}
