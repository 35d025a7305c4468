"""FedAvg, FedProx and FedAtt: weight averaging, a proximal term, attentive averaging."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protofl.algorithms.base import Algorithm, Tensors


class FedAvg(Algorithm):
    name = "fedavg"
    description = "FedAvg (McMahan et al.): W = sum n_k W_k / sum n_k; stragglers dropped"


def proximal_term(params: Tensors, anchor: Tensors) -> torch.Tensor:
    """``||W - W^t||^2`` summed over every parameter tensor."""
    return sum(((params[k] - anchor[k]) ** 2).sum() for k in params)


@dataclass
class ProxOptions:
    mu: float = 0.01


class FedProx(Algorithm):
    name = "fedprox"
    description = "FedProx (Li et al.): local loss + mu/2 ||W - W^t||^2; partial work tolerated"
    Options = ProxOptions
    tolerate_partial = True
    nonnegative = ("mu",)

    def client_begin(self, model, glob, client_state, x, y):
        return {"anchor": glob["params"]}

    def loss(self, model, params, buffers, x, y, w, ctx):
        return super().loss(model, params, buffers, x, y, w, ctx) + 0.5 * self.opts.mu * (
            proximal_term(params, ctx["anchor"]))


@dataclass
class AttOptions:
    epsilon: float = 1.2


class FedAtt(Algorithm):
    name = "fedatt"
    description = "FedAtt (Ji et al.): per-layer softmax attention over ||w - w_k||, step epsilon"
    Options = AttOptions
    positive = ("epsilon",)

    def aggregate(self, state, uploads):
        new, diag = super().aggregate(state, uploads)  # buffers (if any) by FedAvg
        new["params"] = attentive_update(state["params"], [u["params"] for u in uploads],
                                         self.opts.epsilon)
        return new, diag


def attentive_update(glob: Tensors, locals_: list[Tensors], epsilon: float) -> Tensors:
    """Per tensor l: ``s_k = ||w^l - w_k^l||``, ``alpha = softmax_k(s)``,
    ``w^l <- w^l - epsilon * sum_k alpha_k (w^l - w_k^l)``."""
    out = {}
    for name, w in glob.items():
        diffs = torch.stack([w - loc[name] for loc in locals_])
        alpha = torch.softmax(diffs.flatten(1).norm(dim=1), dim=0)
        out[name] = w - epsilon * (alpha.reshape(-1, *([1] * w.dim())) * diffs).sum(0)
    return out
