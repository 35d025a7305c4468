"""FedAvg, FedProx and FedAtt: weight averaging, a proximal term, attentive averaging."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import torch

from protofl.algorithms.base import Algorithm, Tensors
from protofl.algorithms.capabilities import Sums
from protofl.config import TASKS, option


class FedAvg(Sums, Algorithm):
    name = "fedavg"
    description = "FedAvg (McMahan et al.): W = sum n_k W_k / sum n_k; stragglers dropped"
    tasks = TASKS


def proximal_term(params: Tensors, anchor: Tensors) -> torch.Tensor:
    """``||W - W^t||^2`` summed over every parameter tensor."""
    return sum(((params[k] - anchor[k]) ** 2).sum() for k in params)


@dataclass
class ProxOptions:
    mu: float = option(0.01, "weight of the proximal term mu/2 ||W - W^t||^2", ge=0)


class ProxContext(TypedDict):
    anchor: Tensors  # the received global parameters W^t


class FedProx(Sums, Algorithm):
    name = "fedprox"
    description = "FedProx (Li et al.): local loss + mu/2 ||W - W^t||^2; partial work tolerated"
    Options = ProxOptions
    client_defaults = {"tolerate_partial": True, "batch_size": 10, "local_epochs": 20}
    client_defaults_source = ("Li et al. 2020 (experimental details): stragglers' partial work "
                              "aggregated, batch 10, E = 20 (the learning rate is tuned per "
                              "dataset, so none is set)")
    tasks = TASKS

    def client_begin(self, c) -> ProxContext:
        return {"anchor": c.broadcast["params"]}

    def loss(self, model, params, buffers, x, y, w, ctx):
        return super().loss(model, params, buffers, x, y, w, ctx) + 0.5 * self.opts.mu * (
            proximal_term(params, ctx["anchor"]))


@dataclass
class AttOptions:
    epsilon: float = option(1.2, "server step size of the attentive update", gt=0)


class FedAtt(Algorithm):
    name = "fedatt"
    description = "FedAtt (Ji et al.): per-layer softmax attention over ||w - w_k||, step epsilon"
    Options = AttOptions
    tasks = TASKS
    individual_reason = "its attention is a softmax over each client's distance to the model"

    def aggregate(self, state, uploads, round):
        new, diag = super().aggregate(state, uploads, round)  # buffers (if any) by FedAvg
        new["params"], alpha = attentive_update(state["params"], [u["params"] for u in uploads],
                                                self.opts.epsilon)
        diag["weights"] = alpha.mean(0).tolist()  # the attention actually used, mean over tensors
        return new, diag


def attentive_update(current: Tensors, locals_: list[Tensors], epsilon: float
                     ) -> tuple[Tensors, torch.Tensor]:
    """Per tensor l: ``s_k = ||w^l - w_k^l||``, ``alpha = softmax_k(s)``,
    ``w^l <- w^l - epsilon * sum_k alpha_k (w^l - w_k^l)``. Returns the new tensors and the
    attention ``(tensors, K)``."""
    out, alphas = {}, []
    for name, w in current.items():
        diffs = torch.stack([w - loc[name] for loc in locals_])
        alpha = torch.softmax(diffs.flatten(1).norm(dim=1), dim=0)
        out[name] = w - epsilon * (alpha.reshape(-1, *([1] * w.dim())) * diffs).sum(0)
        alphas.append(alpha)
    return out, torch.stack(alphas).to(torch.float64)
