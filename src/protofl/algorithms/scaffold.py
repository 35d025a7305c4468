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
solver (``fednova.client_norm``: K for plain SGD), so (x - y_i) / (||a||_1 eta_l) is still
the mean corrected gradient the client followed (a reconstruction; the paper's analysis
uses plain SGD). With Adam it is K, and the estimate is of Adam's mean step direction, not
a gradient: use SGD (or option I) for the paper's method.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protofl import tasks
from protofl.algorithms.base import (
    FEATURE_BATCH,
    Algorithm,
    Tensors,
    UploadEntry,
    forward,
    weighted_average,
)
from protofl.algorithms.contract import ClientRound, TrainedClient
from protofl.algorithms.feddyn import linear_term
from protofl.algorithms.fednova import client_norm
from protofl.config import TASKS, option
from protofl.errors import ProtoflError
from protofl.models.nets import ProtoNet


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


def gradient_at(model: ProtoNet, params: Tensors, buffers: Tensors, x: torch.Tensor,
                y: torch.Tensor, rows: int = FEATURE_BATCH) -> Tensors:
    """Option I's g_i(x): the gradient at ``params`` of the mean cross-entropy over every row
    of ``(x, y)``, summed ``rows`` rows at a time (the client passes its batch size: a
    training step's memory)."""
    p = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    with torch.enable_grad():
        for i in range(0, len(y), rows):
            _, logits = forward(model, p, buffers, x[i:i + rows])
            part = tasks.per_sample_cross_entropy(logits, y[i:i + rows]).sum() / len(y)
            grads = torch.autograd.grad(part, list(p.values()), allow_unused=True)
            for k, g in zip(p, grads):
                if g is not None:
                    total[k] += g
    return total


def zeros_like(tree: Tensors) -> Tensors:
    return {k: torch.zeros_like(v) for k, v in tree.items()}


@dataclass
class ScaffoldOptions:
    variate: str = option("II", "control-variate update: II, from the client's own update "
                          "(the paper's experiments), or I, the gradient at the server "
                          "model over its data (one more pass)", choices=("I", "II"))
    eta_g: float = option(1.0, "global step size eta_g (the paper's experiments: 1)", gt=0)


class Scaffold(Algorithm):
    name = "scaffold"
    description = ("SCAFFOLD (Karimireddy et al.): local steps corrected by c - c_i, control "
                   "variates I or II, x += eta_g mean(y_i - x), c += |S|/N mean(dc_i)")
    Options = ScaffoldOptions
    client_defaults_source = ("Karimireddy et al. 2020 (experiments): eta_g = 1, the local "
                              "step size tuned per method (none set)")
    tasks = TASKS
    individual_reason = ("its control-variate updates dc_i would reach the server unclipped "
                         "and without noise: DP clips and noises the model weights only")

    def init_state(self, model):
        state = super().init_state(model)
        state["c"] = zeros_like(state["params"])
        return state

    def broadcast(self, state):
        return {**super().broadcast(state), "c": state["c"]}

    def client_begin(self, c: ClientRound):
        ci = c.state.get("c") or zeros_like(c.broadcast["c"])
        return {"correction": {k: c.broadcast["c"][k] - ci[k] for k in ci}}

    def loss(self, model, params, buffers, x, y, w, ctx):
        """The local loss plus <c - c_i, W>: its gradient is the corrected g - c_i + c."""
        return (super().loss(model, params, buffers, x, y, w, ctx)
                + linear_term(ctx["correction"], params))

    def client_end(self, t: TrainedClient):
        upload, _ = super().client_end(t)
        x, c = t.broadcast["params"], t.broadcast["c"]
        ci = t.state.get("c") or zeros_like(c)
        if self.opts.variate == "I":
            new = gradient_at(t.model, x, t.broadcast["buffers"], t.x, t.y, t.batch_size)
        else:
            norm = client_norm(t)
            new = control_option2(ci, c, x, t.params, norm, t.lr) if norm > 0 else ci
        upload["control"] = {k: new[k] - ci[k] for k in ci}
        return upload, {**t.state, "c": new}

    def upload_spec(self):
        spec = super().upload_spec()
        spec.update({f"control.{k[len('params.'):]}": UploadEntry(e.shape)
                     for k, e in spec.items() if k.startswith("params.")})
        return spec

    def aggregate(self, state, uploads, round):
        if self.federation is None:
            raise ProtoflError("scaffold: the server update needs the federation's client "
                               "count; build the algorithm with a FederationInfo")
        params, c = server_step(state["params"], state["c"], [u["params"] for u in uploads],
                                [u["control"] for u in uploads], self.opts.eta_g,
                                self.federation.num_clients)
        uniform = torch.full((len(uploads),), 1.0 / len(uploads), dtype=torch.float64)
        buffers = weighted_average([u["buffers"] for u in uploads], uniform) if (
            uploads[0].get("buffers")) else {}
        return {**state, "params": params, "buffers": buffers, "c": c}, {
            "weights": uniform.tolist()}
