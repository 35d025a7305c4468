"""FedGH (Yi et al., ACM MM 2023, "FedGH: heterogeneous federated learning with generalized
global header"; HtFLlib's ``FedGH``).

Every client keeps its own body (``capabilities.Personalized``; clients may train different
bodies of the same feature size d) and trains its model with plain cross-entropy, starting
each round from the global head (the ``classifier.*`` linear layer, as ``lgfedavg``). After
local training it uploads its class prototypes ``p_k[c]`` (class-mean features of its data
under the trained model) and class counts. The server trains the generalized global head
``g`` on the uploaded pairs ``(p_k[c], c)`` with ``CE(g(p), c)``: ``server_epochs`` epochs of
mini-batches of ``server_batch`` pairs, SGD with ``server_lr`` (batch order from a generator
keyed by the state's seed and the round), and sends it back; clients replace their head with
it and are scored with their own body and the global head. The first global head is that of
the first model's initial weights (HtFLlib: client 0's).

Defaults: server_epochs 100, server_lr 0.01, server_batch 10, from HtFLlib (``-se`` 100,
``-slr`` 0.01, and its server's loader batch, the clients' batch size 10); the paper's text
was not available here, so these are HtFLlib's settings, not checked against the paper.
Under client-level DP the head is trained on the noised mean prototype of each class (one
pair per class) instead of every client's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.func import functional_call

from protofl.algorithms.base import (
    Algorithm,
    Tensors,
    UploadEntry,
    Weights,
    class_prototypes,
    sample_count,
    split_state,
)
from protofl.algorithms.capabilities import Prototypes, Sums
from protofl.algorithms.lgfedavg import HEAD, GlobalHead
from protofl.algorithms.optimizers import server_train
from protofl.config import option
from protofl.seeding import SERVER, torch_gen


@dataclass
class FedGHOptions:
    server_epochs: int = option(100, "server epochs of head training per round (HtFLlib's "
                                     "-se default)", ge=1)
    server_lr: float = option(0.01, "server SGD learning rate (HtFLlib's -slr default)", gt=0)
    server_batch: int = option(10, "uploaded prototypes per server mini-batch (HtFLlib: the "
                                   "clients' batch size, 10)", ge=1)


def head_logits(model, head: Tensors, p: torch.Tensor) -> torch.Tensor:
    """The logits of features ``p (n, d)`` under head parameters ``head`` (``classifier.*``)."""
    weights = {k[len(HEAD):]: v for k, v in head.items()}
    return functional_call(model.classifier, weights, (p.to(next(iter(head.values())).dtype),))


def train_head(model, head: Tensors, p: torch.Tensor, y: torch.Tensor, opts: FedGHOptions,
               gen: torch.Generator) -> tuple[Tensors, list[float]]:
    """``server_epochs`` epochs of plain SGD on ``CE(g(p), y)``; new head and per-epoch mean
    losses."""
    def loss(w: Tensors, idx: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head_logits(model, w, p[idx]), y[idx])
    return server_train(head, loss, len(y), opts.server_epochs, opts.server_batch,
                        opts.server_lr, gen)


class FedGH(GlobalHead, Prototypes, Sums, Algorithm):
    name = "fedgh"
    description = ("FedGH (Yi et al. 2023): personalised bodies, clients upload class "
                   "prototypes, the server trains a generalized global head on them")
    Options = FedGHOptions
    client_defaults = {"optimizer": "sgd", "lr": 0.01, "batch_size": 10, "local_epochs": 1}
    client_defaults_source = ("HtFLlib (main.py defaults, which its FedGH uses): SGD, "
                              "lr 0.01, batch 10, E = 1")
    fallback = ("under DP the global head trains on the noised mean prototype of each class "
                "instead (one pair per class)")

    def sums_reason(self):
        return "its server trains the global head on every client's prototypes"

    def init_state(self, model):
        params, buffers = split_state(model)
        seed = int(torch.randint(0, 2**31 - 1, (), device="cpu"))  # the run's seeded RNG
        return {"init": {"params": params, "buffers": buffers},
                "head": {k: v.clone() for k, v in self.check_head(model).items()},
                "seed": torch.tensor(seed)}

    def broadcast(self, state):
        return {"init": state["init"], "head": state["head"]}

    def aggregate(self, state, uploads, round):
        protos = torch.stack([u["protos"] for u in uploads])  # (K, C, d)
        holds = torch.stack([u["counts"] for u in uploads]) > 0  # (K, C)
        diag: dict = {"classes": holds.sum(0).tolist()}
        if not holds.any():  # nothing to train on (e.g. every count below a DP threshold)
            return dict(state), diag
        p, y = protos[holds], holds.nonzero()[:, 1]
        gen = torch_gen(int(state["seed"]), SERVER, round)
        head, history = train_head(self.model, state["head"], p, y, self.opts, gen)
        new = dict(state)
        new["head"] = head
        diag["server_loss"] = [history[0], history[-1]]
        return new, diag

    def client_end(self, t):
        protos, counts = class_prototypes(t.model, t.params, t.buffers, t.x, t.y,
                                          self.num_classes)
        up = {"protos": protos.to(torch.float32), "counts": counts.to(torch.float32),
              "num_samples": sample_count(t.y)}
        own: Weights = {"params": t.params, "buffers": t.buffers}
        return up, dict(own)

    def upload_spec(self):
        return {"protos": UploadEntry((self.num_classes, self.model.feature_dim),
                                      kind="prototypes", weighed_by="counts"),
                "counts": UploadEntry((self.num_classes,), count=True, kind="counts"),
                "num_samples": UploadEntry((), count=True, kind="size")}
