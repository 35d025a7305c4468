"""FD, federated distillation (Jeong et al. 2018, "Communication-efficient on-device machine
learning: federated distillation and augmentation"; HtFLlib's ``FD``, also called FedDistill).

No model averaging: every client keeps its own model (``capabilities.Personalized``; clients
may train different models) and is scored with it, by its own logits. Clients exchange only
per-class mean logits ``l_k[c] (C,)``: with ``logit_pass: training`` (default) the mean of
the logits of the last local epoch's training pass (the paper's Algorithm 1 accumulates them
while training; HtFLlib does too, over all local epochs: the same at its default E = 1), with
``after`` the class means of the trained model's logits over the client's data. Server:
``L[c] = mean over the active clients holding c of l_k[c]`` (unweighted, as HtFLlib's
``proto_aggregation``); a class no active client holds keeps its previous global logit.
Client loss ``CE + lambda * D(logits, L[y])`` with ``D`` the MSE over the C logits
(``distill: mse``, default) and no term for a class without a global logit yet.

Defaults: lambda = 1 (HtFLlib's ``-lam`` default; the distillation weight is not given in
the text available here). The MSE form is the reading of Jeong et al. of issue 31 (paper
text not available here); ``distill: soft_ce`` is HtFLlib's ``clientfd.py``, which applies
its cross-entropy loss to the logits with the global mean logit of the label as the
(unnormalised) soft target.

Server state: ``init`` (the common initial weights), ``logits (C, C)`` and ``present (C,)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from protofl.algorithms import prototype_math
from protofl.algorithms.base import (
    FEATURE_BATCH,
    Algorithm,
    UploadEntry,
    Weights,
    forward,
    sample_count,
    split_state,
    weighted_mean,
)
from protofl.algorithms.capabilities import Personalized, Sums
from protofl.algorithms.fedproto import (
    PROTO_PASSES,
    pass_means,
    pass_sums,
    prototype_regulariser,
)
from protofl.config import option

DISTILL = ("mse", "soft_ce")


@dataclass
class FDOptions:
    lam: float = option(1.0, "weight of the distillation term (HtFLlib's -lam default)", ge=0)
    distill: str = option("mse", "distillation term: mse (mean squared error of the logits to "
                                 "the global mean logit of the label: Jeong et al. as issue 31 "
                                 "reads them) or soft_ce (cross-entropy of the logits against "
                                 "that global logit as an unnormalised soft target: HtFLlib's "
                                 "FD)", choices=DISTILL)
    logit_pass: str = option("training", "when the uploaded class-mean logits are taken: "
                                         "training (the last local epoch's training pass, "
                                         "each batch under its step's weights: the paper's "
                                         "Algorithm 1 and HtFLlib) or after (class means of "
                                         "the trained model's logits over the client's data)",
                             choices=PROTO_PASSES)


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor, present: torch.Tensor,
                       y: torch.Tensor) -> torch.Tensor:
    """Per-sample ``-sum_j L[y]_j log softmax(logits)_j``, 0 where class y has no global
    logit (HtFLlib's CE with probabilities as targets, fed the raw global logits)."""
    ce = -(target[y].to(logits.dtype) * F.log_softmax(logits, dim=1)).sum(1)
    return torch.where(present[y] > 0, ce, torch.zeros_like(ce))


@torch.no_grad()
def all_logits(model, params, buffers, x: torch.Tensor) -> torch.Tensor:
    """The logits of every row of ``x`` under the given weights, a batch at a time."""
    return torch.cat([forward(model, params, buffers, x[i:i + FEATURE_BATCH])[1]
                      for i in range(0, len(x), FEATURE_BATCH)])


class FD(Personalized, Sums, Algorithm):
    name = "fd"
    description = ("FD / FedDistill (Jeong et al. 2018): personalised models, clients share "
                   "per-class mean logits, CE + lambda MSE to the global mean logit")
    Options = FDOptions
    client_defaults = {"optimizer": "sgd", "lr": 0.01, "batch_size": 10, "local_epochs": 1}
    client_defaults_source = ("HtFLlib (main.py defaults, which its FD uses): SGD, lr 0.01, "
                              "batch 10, E = 1")

    def init_state(self, model):
        params, buffers = split_state(model)
        return {"init": {"params": params, "buffers": buffers},
                "logits": torch.zeros(self.num_classes, self.num_classes),
                "present": torch.zeros(self.num_classes)}

    def broadcast(self, state):
        return {"init": state["init"], "logits": state["logits"], "present": state["present"]}

    def aggregate(self, state, uploads, round):
        logits = torch.stack([u["logits"] for u in uploads])
        holds = torch.stack([u["counts"] for u in uploads]) > 0
        new = dict(state)
        new["logits"] = prototype_math.aggregate_prototypes(
            logits, holds.to(logits.dtype), state["logits"])
        new["present"] = torch.maximum(state["present"], holds.any(0).to(state["present"].dtype))
        return new, {"classes": holds.sum(0).tolist()}

    # ---- client ----
    def client_begin(self, c):
        return {"logits": c.broadcast["logits"], "present": c.broadcast["present"]}

    def distill_term(self, logits: torch.Tensor, y: torch.Tensor, ctx) -> torch.Tensor:
        """Per-sample distillation term against the global logits of ``ctx``."""
        if self.opts.distill == "soft_ce":
            return soft_cross_entropy(logits, ctx["logits"], ctx["present"], y)
        return prototype_regulariser(logits, y, ctx["logits"].to(logits.dtype), ctx["present"])

    def loss_and_logits(self, model, params, buffers, x, y, w, ctx):
        _, logits = forward(model, params, buffers, x)
        ce = F.cross_entropy(logits, y, reduction="none")
        return weighted_mean(ce + self.opts.lam * self.distill_term(logits, y, ctx), w), logits

    def loss(self, model, params, buffers, x, y, w, ctx):
        return self.loss_and_logits(model, params, buffers, x, y, w, ctx)[0]

    def loss_and_stats(self, model, params, buffers, x, y, w, ctx):
        """The loss and, with ``logit_pass: training``, the batch's class sums of logits."""
        loss, logits = self.loss_and_logits(model, params, buffers, x, y, w, ctx)
        if self.opts.logit_pass != "training":
            return loss, {}
        return loss, pass_sums(logits, y, w, self.num_classes)

    def client_end(self, t):
        if self.opts.logit_pass == "training":
            logits, counts = pass_means(self.name, "logit_pass", t.stats)
        else:
            logits, counts = prototype_math.class_means(
                all_logits(t.model, t.params, t.buffers, t.x).to(torch.float32), t.y,
                self.num_classes)
        up = {"logits": logits, "counts": counts, "num_samples": sample_count(t.y)}
        own: Weights = {"params": t.params, "buffers": t.buffers}
        return up, dict(own)

    def upload_spec(self):
        c = self.num_classes
        return {"logits": UploadEntry((c, c), kind="prototypes", weighed_by="counts"),
                "counts": UploadEntry((c,), count=True, kind="presence"),
                "num_samples": UploadEntry((), count=True, kind="size")}
