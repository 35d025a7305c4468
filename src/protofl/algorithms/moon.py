"""MOON (Li, He & Song, CVPR 2021): model-contrastive federated learning.

Local loss ``CE + mu * l_con`` with, per sample,
``l_con = -log(e^{cos(h, h_g)/tau} / (e^{cos(h, h_g)/tau} + e^{cos(h, h_prev)/tau}))``,
where ``h`` is the projection-head output of the model being trained, ``h_g`` that of the
received global model (frozen) and ``h_prev`` that of this client's model after its previous
participation (the global model on a first participation, as MOON does). Every weight,
projection head included, is averaged by FedAvg.

The network (``head``): ``paper`` (default) is MOON's, encoder -> projection head (a 2-layer
MLP, ``Linear(d, d) - ReLU - Linear(d, proj_dim)``) -> classifier ``Linear(proj_dim, C)``
(:class:`MoonNet`; the plain model's own classifier is left unused); ``side`` keeps the
model's classifier on the encoder output z and hangs the projection head beside it, used only
by the contrastive term (protofl 0.1.0). In both, the features protofl's metrics read
(prototypes, AMM, FFD, t-SNE) are the encoder's output z, the layer shared by every
algorithm, and not the projection h (which lives in the contrastive loss's space).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from protofl.algorithms.base import Algorithm, Tensors, Weights, forward, weighted_mean
from protofl.algorithms.capabilities import Sums
from protofl.config import option
from protofl.models.nets import ProtoNet

HEAD = "projection"  # name of the projection-head submodule


@dataclass
class MoonOptions:
    mu: float = option(1.0, "weight of the contrastive term (mu = 0 is FedAvg)", ge=0)
    tau: float = option(0.5, "temperature", gt=0)
    proj_dim: int = option(256, "output size of the projection head", ge=1)
    head: str = option("paper", "network: encoder -> projection -> classifier (paper), or the "
                                "classifier on z with the projection beside it (side)",
                       choices=("paper", "side"))


class MoonContext(TypedDict):
    global_model: Weights  # the received global model (the positive), frozen
    prev: Weights  # this client's model after its previous participation (the negative)


class MoonClientState(TypedDict):
    prev: Weights


def projection_head(d: int, out: int) -> nn.Sequential:
    """MOON's projection head ``Linear(d, d) - ReLU - Linear(d, out)``."""
    return nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, out))


class MoonNet(ProtoNet):
    """MOON's network around an encoder: ``encode(x)`` is the encoder's z, ``head(z)`` is
    ``classifier(projection(z))``. Parameters: ``backbone.*``, ``projection.*``,
    ``classifier.*``."""

    def __init__(self, backbone: ProtoNet, num_classes: int, proj_dim: int):
        super().__init__()
        self.backbone = backbone
        self.feature_dim = backbone.feature_dim
        self.projection = projection_head(backbone.feature_dim, proj_dim)
        self.classifier = nn.Linear(proj_dim, num_classes)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone.encode(x)

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.projection(z))

    def forward(self, x: torch.Tensor, with_projection: bool = False):
        """``(z, logits)``, or ``(z, logits, h)`` with the projection ``h`` the logits came
        from (computed once)."""
        z = self.encode(x)
        h = self.projection(z)
        logits = self.classifier(h)
        return (z, logits, h) if with_projection else (z, logits)


def contrastive_term(h: torch.Tensor, h_global: torch.Tensor, h_prev: torch.Tensor,
                     tau: float) -> torch.Tensor:
    """Per-sample ``l_con``: cross-entropy of the positive pair (h, h_g) against (h, h_prev)."""
    sims = torch.stack([F.cosine_similarity(h, h_global, dim=1),
                        F.cosine_similarity(h, h_prev, dim=1)], dim=1) / tau
    return torch.logsumexp(sims, dim=1) - sims[:, 0]


def head_params(tree: Tensors) -> Tensors:
    prefix = HEAD + "."
    return {k[len(prefix):]: v for k, v in tree.items() if k.startswith(prefix)}


def projected(model: ProtoNet, params: Tensors, buffers: Tensors, x: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, logits)``: the projection of the features and the class logits."""
    if isinstance(model, MoonNet):  # the logits are computed from h: project once
        _, logits, h = functional_call(model, {**params, **buffers}, (x,),
                                       {"with_projection": True}, strict=False)
        return h, logits
    z, logits = forward(model, params, buffers, x)
    head = getattr(model, HEAD)
    return functional_call(head, {**head_params(params), **head_params(buffers)}, (z,)), logits


def copy_weights(tree: Weights) -> Weights:
    """Detached copies (BatchNorm may update buffers in place during a forward)."""
    return {"params": {k: v.detach() for k, v in tree["params"].items()},
            "buffers": {k: v.detach().clone() for k, v in tree["buffers"].items()}}


class Moon(Sums, Algorithm):
    name = "moon"
    description = ("MOON (Li et al. 2021): CE + mu * model-contrastive loss on a projection "
                   "head (global model positive, previous local model negative); FedAvg")
    Options = MoonOptions
    client_defaults = {"optimizer": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-5,
                       "batch_size": 64, "local_epochs": 10}
    client_defaults_source = ("Li, He & Song 2021 (experimental setup; the authors' code "
                              "agrees): SGD, lr 0.01, momentum 0.9, weight decay 1e-5, "
                              "batch 64, E = 10")

    def wrap_model(self, model: ProtoNet) -> ProtoNet:
        """``paper``: the encoder inside a :class:`MoonNet` (the same module on every call);
        ``side``: the model with a projection head added beside its classifier (once)."""
        if self.opts.head == "side":
            if not hasattr(model, HEAD):
                model.add_module(HEAD, projection_head(model.feature_dim, self.opts.proj_dim))
            return model
        return self.wrapped(model, MoonNet,
                            lambda m: MoonNet(m, self.num_classes, self.opts.proj_dim))

    def client_begin(self, c) -> MoonContext:
        prev = c.state.get("prev", c.broadcast)
        return {"global_model": copy_weights(c.broadcast), "prev": copy_weights(prev)}

    def loss(self, model, params, buffers, x, y, w, ctx):
        h, logits = projected(model, params, buffers, x)
        ce = F.cross_entropy(logits, y, reduction="none")
        with torch.no_grad():
            g, prev = ctx["global_model"], ctx["prev"]
            h_global = projected(model, g["params"], g["buffers"], x)[0]
            h_prev = projected(model, prev["params"], prev["buffers"], x)[0]
        con = contrastive_term(h, h_global, h_prev, self.opts.tau)
        return weighted_mean(ce + self.opts.mu * con, w)

    def client_end(self, t):
        up, _ = super().client_end(t)
        state: MoonClientState = {"prev": {"params": t.params, "buffers": t.buffers}}
        return up, dict(state)
