"""FedProto (Tan et al., AAAI 2022; not the first seed's method, which is ``fedmargin``).

No model averaging: every client keeps its own model (``capabilities.Personalized``),
starting from the common initial model, and is evaluated on its own test split. Clients
exchange only class prototypes: with ``proto_pass: after`` (default; Tan et al.'s Eq. 4) the
class means of the client's data under its trained model, with ``training`` the mean of the
features of its last local epoch's training pass, each batch under the weights of the step
that trained on it (Tan et al.'s code, HtFLlib's FedProto). Local loss
``CE + lambda * MSE(f(x), C^y)`` (MSE = mean over the d channels), with no regulariser for
classes that have no global prototype yet. Server: ``C^c = mean over the clients holding c of
their prototypes`` (unweighted); a class no active client holds keeps its previous global
prototype. Inference: the nearest global prototype
(Euclidean), or the client head's logits while no global prototype exists.

Server state: ``init`` (the common initial weights, sent so that a client's first round starts
from them), ``protos (C, d)`` and ``present (C,)`` (1 where a global prototype exists).
There is no global model, so the state has no ``params``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import torch
import torch.nn.functional as F

from protofl.algorithms import prototype_math
from protofl.algorithms.base import (
    Algorithm,
    UploadEntry,
    Weights,
    class_prototypes,
    forward,
    sample_count,
    split_state,
    weighted_mean,
)
from protofl.algorithms.capabilities import Personalized, Prototypes, Sums
from protofl.algorithms.contract import TrainedClient
from protofl.config import option
from protofl.errors import ProtoflError

FAR = 1e4  # score penalty of classes without a global prototype (finite: keeps CE finite)


PROTO_PASSES = ("after", "training")  # the values of algo.proto_pass


def proto_pass_option():
    return option("after", "when a client's prototypes are taken: after (class means of the "
                           "trained model over its data: Tan et al.'s Eq. 4) or training (the "
                           "mean of the features of its last local epoch's training pass, each "
                           "batch under the weights of its step: Tan et al.'s and HtFLlib's "
                           "FedProto code)", choices=PROTO_PASSES)


@dataclass
class FedProtoOptions:
    lam: float = option(1.0, "weight of the prototype regulariser", ge=0)
    proto_pass: str = proto_pass_option()


class FedProtoState(TypedDict):
    init: Weights  # the common initial weights (a client's first round starts from them)
    protos: torch.Tensor  # global class prototypes C^c (C, d)
    present: torch.Tensor  # (C,) 1 where a global prototype exists


class FedProtoUpload(TypedDict):
    protos: torch.Tensor  # the client's class prototypes (C, d)
    counts: torch.Tensor  # its class counts (C,)
    num_samples: torch.Tensor


def prototype_regulariser(z: torch.Tensor, y: torch.Tensor, protos: torch.Tensor,
                          present: torch.Tensor) -> torch.Tensor:
    """Per-sample ``mean_i (z_i - C^y_i)^2``, 0 where class y has no global prototype."""
    target = protos[y]
    mse = ((z - target) ** 2).mean(dim=1)
    return torch.where(present[y] > 0, mse, torch.zeros_like(mse))


def pass_sums(z: torch.Tensor, y: torch.Tensor, w: torch.Tensor, num_classes: int
              ) -> dict[str, torch.Tensor]:
    """A batch's per-class feature sums ``(C, d)`` and counts ``(C,)``, rows weighted by ``w``
    (padding 0; vmap-able), detached: the training pass's prototypes add these up."""
    onehot = (y.unsqueeze(1) == torch.arange(num_classes, device=y.device)).to(z.dtype)
    onehot = onehot * w.to(z.dtype).unsqueeze(1)
    return {"proto_sums": onehot.T @ z.detach(), "proto_counts": onehot.sum(0)}


def client_prototypes(alg: Algorithm, t: TrainedClient) -> tuple[torch.Tensor, torch.Tensor]:
    """A client's class prototypes ``(C, d)`` and counts ``(C,)`` as ``alg.opts.proto_pass``
    says: the trained model's class means over its data (``after``), or the last pass's sums
    ``t.stats`` of :func:`pass_sums` (``training``)."""
    if alg.opts.proto_pass == "training":
        return pass_means(alg.name, "proto_pass", t.stats)
    return class_prototypes(t.model, t.params, t.buffers, t.x, t.y, alg.num_classes)


def pass_means(name: str, option: str, stats: dict | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The class means ``(C, n)`` and counts ``(C,)`` of the last pass's :func:`pass_sums`
    (float32); one line naming algorithm ``name``'s ``option`` without them."""
    if not stats or "proto_sums" not in stats:
        raise ProtoflError(f"{name}: {option}: training needs the trainer's last-pass sums "
                           "(TrainedClient.stats)")
    counts = stats["proto_counts"].to(torch.float32)
    return (stats["proto_sums"] / stats["proto_counts"].clamp_min(1).unsqueeze(1)
            ).to(torch.float32), counts


def nearest_prototype_scores(z: torch.Tensor, protos: torch.Tensor, present: torch.Tensor
                             ) -> torch.Tensor:
    """Class scores ``-||z - C^c||``; classes without a prototype get ``-FAR`` more."""
    dist = prototype_math.pairwise_distance(z, protos.to(z.dtype))
    return -dist - FAR * (present <= 0).to(z.dtype)


class FedProto(Personalized, Prototypes, Sums, Algorithm):
    name = "fedproto"
    description = ("FedProto (Tan et al. 2022; not the seed's method): personalised models, "
                   "CE + lambda MSE to global class prototypes, nearest-prototype inference")
    Options = FedProtoOptions

    def init_state(self, model) -> FedProtoState:
        params, buffers = split_state(model)
        d = model.feature_dim
        return {"init": {"params": params, "buffers": buffers},
                "protos": torch.zeros(self.num_classes, d),
                "present": torch.zeros(self.num_classes)}

    def broadcast(self, state):
        return {"init": state["init"], "protos": state["protos"],
                "present": state["present"]}

    def aggregate(self, state, uploads, round):
        protos = torch.stack([u["protos"] for u in uploads])
        holds = torch.stack([u["counts"] for u in uploads]) > 0
        new = dict(state)
        new["protos"] = prototype_math.aggregate_prototypes(protos, holds.to(protos.dtype),
                                                state["protos"])
        new["present"] = torch.maximum(state["present"], holds.any(0).to(state["present"].dtype))
        return new, {"classes": holds.sum(0).tolist()}

    # ---- client ----
    def client_begin(self, c):
        return {"protos": c.broadcast["protos"], "present": c.broadcast["present"]}

    def loss(self, model, params, buffers, x, y, w, ctx):
        return self.loss_and_features(model, params, buffers, x, y, w, ctx)[0]

    def loss_and_features(self, model, params, buffers, x, y, w, ctx):
        z, logits = forward(model, params, buffers, x)
        ce = F.cross_entropy(logits, y, reduction="none")
        reg = prototype_regulariser(z, y, ctx["protos"], ctx["present"])
        return weighted_mean(ce + self.opts.lam * reg, w), z

    def loss_and_stats(self, model, params, buffers, x, y, w, ctx):
        """The loss and, with ``proto_pass: training``, the batch's class sums of features
        (under the weights of this step; the trainers add up the last pass's)."""
        loss, z = self.loss_and_features(model, params, buffers, x, y, w, ctx)
        if self.opts.proto_pass != "training":
            return loss, {}
        return loss, pass_sums(z, y, w, self.num_classes)

    def client_end(self, t):
        protos, counts = client_prototypes(self, t)
        up: FedProtoUpload = {"protos": protos, "counts": counts,
                              "num_samples": sample_count(t.y)}
        own: Weights = {"params": t.params, "buffers": t.buffers}
        return dict(up), dict(own)

    def upload_spec(self):
        return {"protos": UploadEntry((self.num_classes, self.model.feature_dim),
                                      kind="prototypes", weighed_by="counts"),
                "counts": UploadEntry((self.num_classes,), count=True, kind="presence"),
                "num_samples": UploadEntry((), count=True, kind="size")}

    # ---- evaluation ----
    def predict(self, model, params, buffers, state, x):
        z, logits = forward(model, params, buffers, x)
        if not bool((state["present"] > 0).any()):
            return logits
        return nearest_prototype_scores(z, state["protos"], state["present"])

