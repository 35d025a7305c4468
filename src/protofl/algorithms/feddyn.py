"""FedDyn (Acar et al., ICLR 2021): a dynamic regulariser that aligns local and global optima.

Client k keeps the gradient state g_k (0 at first) and minimises
``L_k(W) - <g_k, W> + alpha/2 ||W - W^t||^2``; after training it updates
``g_k <- g_k - alpha (W_k - W^t)``. The server keeps h (0 at first) and, over the round's
active clients P,

    h   <- h - alpha / m * sum_{k in P} (W_k - W^t)      (m: every client of the federation)
    W^{t+1} = mean_{k in P} W_k - h / alpha

so the server needs the federation's client count (``Algorithm.federation``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protofl.algorithms.base import Algorithm, Tensors, weighted_average
from protofl.algorithms.fedavg import proximal_term
from protofl.config import TASKS, option
from protofl.errors import ProtoflError


@dataclass
class DynOptions:
    alpha: float = option(0.01, "alpha, the weight of the dynamic regulariser", gt=0)


def linear_term(grad: Tensors, params: Tensors) -> torch.Tensor:
    """``<g, W>`` summed over every parameter tensor."""
    return sum((grad[k] * params[k]).sum() for k in params)


class FedDyn(Algorithm):
    name = "feddyn"
    description = ("FedDyn (Acar et al.): local loss - <g_k, W> + alpha/2 ||W - W^t||^2, "
                   "server correction h over all m clients")
    Options = DynOptions
    client_defaults = {"batch_size": 50, "local_epochs": 5, "lr": 0.1, "weight_decay": 1e-3}
    client_defaults_source = ("Acar et al. 2021 (experiments; the authors' scripts: batch 50, "
                              "E = 5, SGD lr 0.1, weight decay 1e-3, alpha 0.01; their lr decay "
                              "of 0.998 per round is not applied)")
    tasks = TASKS
    individual_reason = ("its server correction h counts the round's clients against all m, "
                        "and the sums' estimate carries no count of contributions")

    def init_state(self, model):
        state = super().init_state(model)
        state["h"] = {k: torch.zeros_like(v) for k, v in state["params"].items()}
        return state

    def client_begin(self, c):
        grad = c.state.get("grad") or {
            k: torch.zeros_like(v) for k, v in c.broadcast["params"].items()}
        return {"anchor": c.broadcast["params"], "grad": grad}

    def loss(self, model, params, buffers, x, y, w, ctx):
        return (super().loss(model, params, buffers, x, y, w, ctx)
                - linear_term(ctx["grad"], params)
                + 0.5 * self.opts.alpha * proximal_term(params, ctx["anchor"]))

    def client_end(self, t):
        upload, _ = super().client_end(t)
        a = self.opts.alpha
        grad = {k: t.ctx["grad"][k] - a * (t.params[k] - t.ctx["anchor"][k]) for k in t.params}
        return upload, {**t.state, "grad": grad}

    def aggregate(self, state, uploads, round):
        if self.federation is None:
            raise ProtoflError("feddyn: the server update needs the federation's client count; "
                               "build the algorithm with a FederationInfo")
        m, a = self.federation.num_clients, self.opts.alpha
        uniform = torch.full((len(uploads),), 1.0 / len(uploads), dtype=torch.float64,
                             device=uploads[0]["num_samples"].device)
        mean = weighted_average([u["params"] for u in uploads], uniform)
        h = {k: state["h"][k] - a / m * sum(u["params"][k] - state["params"][k]
                                            for u in uploads) for k in mean}
        new = {**state, "h": h, "params": {k: mean[k] - h[k] / a for k in mean}}
        new["buffers"] = weighted_average([u["buffers"] for u in uploads], uniform) if (
            uploads[0].get("buffers")) else {}
        return new, {"weights": uniform.tolist()}
