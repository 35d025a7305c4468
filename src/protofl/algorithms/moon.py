"""MOON (Li, He & Song, CVPR 2021): model-contrastive federated learning.

Local loss ``CE + mu * l_con`` with, per sample,
``l_con = -log(e^{cos(h, h_g)/tau} / (e^{cos(h, h_g)/tau} + e^{cos(h, h_prev)/tau}))``,
where ``h`` is the projection-head output of the model being trained, ``h_g`` that of the
received global model (frozen) and ``h_prev`` that of this client's model after its previous
participation (the global model on a first participation, as MOON does). The projection head
(a 2-layer MLP on the features z) is added to the model by ``wrap_model`` and is averaged with
the rest of the weights (FedAvg aggregation). The classifier stays the model's own head on z
(MOON's reference network puts its classifier after the projection; here the projection is a
side branch so that z, the prototypes and every other metric mean the same as for the other
algorithms).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from protofl.algorithms.base import Algorithm, Tensors, Weights, forward, weighted_mean
from protofl.config import option
from protofl.models.nets import ProtoNet

HEAD = "projection"  # name of the projection-head submodule


@dataclass
class MoonOptions:
    mu: float = option(1.0, "weight of the contrastive term (mu = 0 is FedAvg)", ge=0)
    tau: float = option(0.5, "temperature", gt=0)
    proj_dim: int = option(256, "output size of the projection head", ge=1)


class MoonContext(TypedDict):
    glob: Weights  # the received global model (the positive), frozen
    prev: Weights  # this client's model after its previous participation (the negative)


class MoonClientState(TypedDict):
    prev: Weights


def contrastive_term(h: torch.Tensor, h_glob: torch.Tensor, h_prev: torch.Tensor,
                     tau: float) -> torch.Tensor:
    """Per-sample ``l_con``: cross-entropy of the positive pair (h, h_g) against (h, h_prev)."""
    sims = torch.stack([F.cosine_similarity(h, h_glob, dim=1),
                        F.cosine_similarity(h, h_prev, dim=1)], dim=1) / tau
    return torch.logsumexp(sims, dim=1) - sims[:, 0]


def head_params(tree: Tensors) -> Tensors:
    prefix = HEAD + "."
    return {k[len(prefix):]: v for k, v in tree.items() if k.startswith(prefix)}


def projected(model: ProtoNet, params: Tensors, buffers: Tensors, x: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, logits)``: the projection of the features and the class logits."""
    z, logits = forward(model, params, buffers, x)
    head = getattr(model, HEAD)
    return functional_call(head, {**head_params(params), **head_params(buffers)}, (z,)), logits


def copy_weights(tree: Weights) -> Weights:
    """Detached copies (BatchNorm may update buffers in place during a forward)."""
    return {"params": {k: v.detach() for k, v in tree["params"].items()},
            "buffers": {k: v.detach().clone() for k, v in tree["buffers"].items()}}


class Moon(Algorithm):
    name = "moon"
    description = ("MOON (Li et al. 2021): CE + mu * model-contrastive loss on a projection "
                   "head (global model positive, previous local model negative); FedAvg")
    Options = MoonOptions

    def wrap_model(self, model: ProtoNet) -> ProtoNet:
        """Add the projection head ``Linear(d, d) - ReLU - Linear(d, proj_dim)`` (once)."""
        if not hasattr(model, HEAD):
            d = model.feature_dim
            model.add_module(HEAD, nn.Sequential(nn.Linear(d, d), nn.ReLU(),
                                                 nn.Linear(d, self.opts.proj_dim)))
        return model

    def client_begin(self, model, broadcast, client_state, x, y) -> MoonContext:
        prev = client_state.get("prev", broadcast)
        return {"glob": copy_weights(broadcast), "prev": copy_weights(prev)}

    def loss(self, model, params, buffers, x, y, w, ctx):
        h, logits = projected(model, params, buffers, x)
        ce = F.cross_entropy(logits, y, reduction="none")
        with torch.no_grad():
            h_glob = projected(model, ctx["glob"]["params"], ctx["glob"]["buffers"], x)[0]
            h_prev = projected(model, ctx["prev"]["params"], ctx["prev"]["buffers"], x)[0]
        con = contrastive_term(h, h_glob, h_prev, self.opts.tau)
        return weighted_mean(ce + self.opts.mu * con, w)

    def client_end(self, model, params, buffers, broadcast, ctx, client_state, x, y):
        up, _ = super().client_end(model, params, buffers, broadcast, ctx, client_state, x, y)
        state: MoonClientState = {"prev": {"params": params, "buffers": buffers}}
        return up, dict(state)
