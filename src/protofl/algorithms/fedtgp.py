"""FedTGP (Zhang et al., AAAI 2024): trainable global prototypes with an adaptive margin.

FedTGP is a heterogeneous-model method in which clients keep their own models, so it is
implemented, like ``fedproto``, with personalised client models (no weight averaging; each
client evaluated with its own model on its own test split; inference = nearest global
prototype). Client loss ``CE + lambda * MSE(f(x), P^y)`` (the fedproto regulariser,
lambda = 10). Clients upload class prototypes and counts.

Server: global prototypes ``P^c = MLP(e_c)`` from trainable class embeddings ``e`` and a
two-layer MLP, kept in the server state. Each round they are trained for ``server_epochs``
epochs over the uploaded prototypes ``(P, y)`` with ``CE(-D, y)``,
``D_c' = ||P - P^c'|| + delta 1[c' = y]``, ``delta = min(max_c min_{c' != c} ||Q^c - Q^c'||,
margin_cap)``, Q^c the mean uploaded prototype of class c this round (classes uploaded this
round only; delta = 0 with fewer than two). Mini-batch order comes from a generator keyed by
(the state's seed, SERVER, round); the optimizer is created afresh each round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from protofl.algorithms import prototype_math
from protofl.algorithms.base import Tensors
from protofl.algorithms.fedproto import FedProto, FedProtoState, proto_pass_option
from protofl.algorithms.optimizers import OPTIMIZERS, server_train
from protofl.config import option
from protofl.seeding import SERVER, torch_gen


@dataclass
class FedTGPOptions:
    lam: float = option(10.0, "weight of the client prototype regulariser", ge=0)
    server_epochs: int = option(100, "server epochs of prototype training per round", ge=1)
    server_lr: float = option(0.01, "server learning rate (the authors' code: the clients' "
                                    "learning rate, 0.01 in their runs)", gt=0)
    server_optimizer: str = option("sgd", "server optimizer", choices=OPTIMIZERS)
    server_batch: int = option(10, "uploaded prototypes per server mini-batch", ge=1)
    hidden: int = option(0, "hidden width of the prototype MLP (0: the feature size d)", ge=0)
    margin_cap: float = option(100.0, "cap of the adaptive margin", ge=0)
    proto_pass: str = proto_pass_option()


class FedTGPState(FedProtoState):
    generator: Tensors  # the prototype generator: class embeddings and MLP weights
    seed: torch.Tensor  # seed of the server-side generators (drawn from the run's RNG)


def adaptive_margin(q: torch.Tensor, present: torch.Tensor, cap: float) -> torch.Tensor:
    """``min(max_c min_{c' != c} ||Q^c - Q^c'||, cap)`` over the present classes (0 if fewer
    than two are present)."""
    # d-: the distance to the nearest other present class
    _, nearest = prototype_math.margins(q, q, present, present)
    nearest = nearest[~torch.isnan(nearest)]
    if len(nearest) == 0:
        return torch.zeros((), dtype=q.dtype)
    return nearest.max().clamp(max=cap)


def generate(g: Tensors) -> torch.Tensor:
    """Global prototypes ``(C, d)``: ``W2 relu(W1 e_c + b1) + b2`` for every class."""
    hidden = torch.addmm(g["b1"], g["emb"], g["w1"].T).relu()
    return torch.addmm(g["b2"], hidden, g["w2"].T)


def margin_loss(g: Tensors, p: torch.Tensor, y: torch.Tensor, delta: torch.Tensor
                ) -> torch.Tensor:
    """Adaptive-margin contrastive loss ``CE(-D, y)`` of uploaded prototypes ``p (n, d)``."""
    dist = prototype_math.pairwise_distance(p, generate(g))
    dist = dist + delta * F.one_hot(y, dist.shape[1]).to(dist.dtype)
    return F.cross_entropy(-dist, y)


def init_generator(num_classes: int, d: int, hidden: int, gen: torch.Generator) -> Tensors:
    """Standard-normal embeddings; linear layers uniform in +-1/sqrt(fan_in)."""
    def uniform(*shape: int, fan_in: int) -> torch.Tensor:
        bound = 1.0 / math.sqrt(fan_in)
        return (torch.rand(*shape, generator=gen) * 2 - 1) * bound

    return {"emb": torch.randn(num_classes, d, generator=gen),
            "w1": uniform(hidden, d, fan_in=d), "b1": uniform(hidden, fan_in=d),
            "w2": uniform(d, hidden, fan_in=hidden), "b2": uniform(d, fan_in=hidden)}


def train_generator(g: Tensors, p: torch.Tensor, y: torch.Tensor, delta: torch.Tensor,
                    opts: FedTGPOptions, gen: torch.Generator) -> tuple[Tensors, list[float]]:
    """``server_epochs`` epochs of the margin loss; returns new weights and per-epoch mean
    losses."""
    p = p.to(torch.promote_types(p.dtype, torch.float32))
    # margin_loss with the margin's one-hot shift built once
    shift = delta * F.one_hot(y, g["emb"].shape[0]).to(p.dtype)

    def loss(w: Tensors, idx: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(-(torch.cdist(p[idx], generate(w)) + shift[idx]), y[idx])
    return server_train(g, loss, len(y), opts.server_epochs, opts.server_batch,
                        opts.server_lr, gen, opts.server_optimizer)


class FedTGP(FedProto):
    name = "fedtgp"
    description = ("FedTGP (Zhang et al. 2024): personalised models, CE + lambda MSE to "
                   "server-trained global prototypes (adaptive-margin contrastive loss)")
    Options = FedTGPOptions
    client_defaults = {"optimizer": "sgd", "lr": 0.01, "batch_size": 10, "local_epochs": 1}
    client_defaults_source = ("Zhang et al. 2024 (the authors' run script): SGD, lr 0.01, "
                              "batch 10, E = 1")
    fallback = ("under DP the generator trains on the noised mean prototype of each "
                        "class instead (one row per class)")

    def sums_reason(self):
        return "its server trains the prototype generator on every client's prototypes"

    def init_state(self, model) -> FedTGPState:
        state = super().init_state(model)
        seed = int(torch.randint(0, 2**31 - 1, (), device="cpu"))  # the run's seeded RNG
        d = model.feature_dim
        state["generator"] = init_generator(self.num_classes, d, self.opts.hidden or d,
                                            torch_gen(seed, SERVER, 0))
        state["seed"] = torch.tensor(seed)
        return state

    def aggregate(self, state, uploads, round):
        protos = torch.stack([u["protos"] for u in uploads])  # (K, C, d)
        holds = torch.stack([u["counts"] for u in uploads]) > 0  # (K, C)
        present = holds.any(0)
        if not present.any():  # no prototype to train on (e.g. all below a DP threshold)
            return dict(state), {"classes": holds.sum(0).tolist()}
        q = prototype_math.aggregate_prototypes(protos, holds.to(protos.dtype),
                                                torch.zeros_like(protos[0]))
        delta = adaptive_margin(q, present, self.opts.margin_cap)
        p, y = protos[holds], holds.nonzero()[:, 1]
        gen = torch_gen(int(state["seed"]), SERVER, round)
        g, history = train_generator(state["generator"], p, y, delta, self.opts, gen)
        new = dict(state)
        new["generator"] = g
        new["protos"] = generate(g).detach()
        new["present"] = torch.maximum(state["present"], present.to(state["present"].dtype))
        return new, {"classes": holds.sum(0).tolist(), "margin": float(delta),
                     "server_loss": [history[0], history[-1]]}
