"""FML, federated mutual learning (Shen et al. 2020, "Federated mutual learning"; HtFLlib's
``FML``).

Every client trains two models together: its own local model (``backbone.*``, personalised;
clients may train different ones) and a copy of the shared "meme" model (``meme.*``, one
architecture for all: a copy of the first model, as HtFLlib builds its global model from
model 0), which the server averages with FedAvg's weights (``lgfedavg``'s rule on the
``meme.*`` parameters). Each learns from the labels and from the other (deep mutual
learning), with one optimizer over both:

    L = alpha CE(local) + (1 - alpha) KL(p_meme || p_local)
      + beta  CE(meme)  + (1 - beta)  KL(p_local || p_meme)

With ``kl: paper`` (default) each KL is summed over the classes and the other model's
distribution is a constant (the paper's mutual learning: each model's loss trains only that
model). ``kl: htfllib`` is HtFLlib's ``clientfml.py``: ``nn.KLDivLoss()``'s mean over the
classes as well as the batch, and no detaching, so each KL term also trains the model whose
distribution is the target (its separate optimizers step on gradients of both losses).
HtFLlib also clips each model's gradient norm at 10; protofl does not. A client is scored
with its local model.

Defaults: alpha = beta = 0.5 (Shen et al.'s setting as issue 31's reading has it; the paper
text was not at hand here); HtFLlib's ``-al``/``-bt`` default to 1.0, which turns both KL
terms off (set ``alpha: 1, beta: 1`` for that). Uploads: ``meme`` and ``num_samples`` (a sum
over clients: DP and secure sums apply, the meme model as model weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.func import functional_call

from protofl.algorithms.base import weighted_mean
from protofl.algorithms.lgfedavg import LGFedAvg
from protofl.config import option
from protofl.models.nets import Beside, ProtoNet

KL_FORMS = ("paper", "htfllib")


@dataclass
class FMLOptions:
    alpha: float = option(0.5, "weight of the local model's CE (1 - alpha: its KL to the meme "
                               "model); HtFLlib's -al default is 1.0", ge=0, le=1)
    beta: float = option(0.5, "weight of the meme model's CE (1 - beta: its KL to the local "
                              "model); HtFLlib's -bt default is 1.0", ge=0, le=1)
    kl: str = option("paper", "the KL terms: paper (summed over the classes, the other model's "
                              "distribution held constant) or htfllib (mean over the classes, "
                              "gradients into both models: HtFLlib's clientfml.py)",
                     choices=KL_FORMS)


class FMLNet(Beside):
    """A client's local model (``backbone``) and the meme model (``meme``) side by side."""

    def __init__(self, backbone: ProtoNet, meme: ProtoNet):
        super().__init__(backbone)
        self.meme = meme

    def forward(self, x: torch.Tensor, with_meme: bool = False):
        """``(z, logits)`` of the local model, and with ``with_meme`` the meme's logits."""
        z, logits = self.backbone(x)
        return (z, logits, self.meme(x)[1]) if with_meme else (z, logits)


def mutual_kl(target: torch.Tensor, logits: torch.Tensor, form: str) -> torch.Tensor:
    """Per-sample ``KL(softmax(target) || softmax(logits))``: ``paper`` summed over the
    classes with ``target`` constant; ``htfllib`` averaged over them, ``target`` trained."""
    if form == "paper":
        target = target.detach()
    log_p = F.log_softmax(target, dim=1)
    kl = (log_p.exp() * (log_p - F.log_softmax(logits, dim=1))).sum(1)
    return kl / logits.shape[1] if form == "htfllib" else kl


class FML(LGFedAvg):
    name = "fml"
    description = ("FML (Shen et al. 2020): personalised local models and a shared meme "
                   "model trained by mutual learning; the meme model averaged (FedAvg)")
    Options = FMLOptions
    shared = "meme."
    key = "meme"
    client_defaults_source = ("HtFLlib (main.py defaults, which its FML uses for both models): "
                              "SGD, lr 0.01, batch 10, E = 1")

    def wrap_model(self, model):
        return self.wrapped(model, FMLNet, lambda m: FMLNet(m, self.shared_copy(m)))

    def loss(self, model, params, buffers, x, y, w, ctx):
        _, logits, meme = functional_call(model, {**params, **buffers}, (x,),
                                          {"with_meme": True}, strict=False)
        o = self.opts
        local = o.alpha * F.cross_entropy(logits, y, reduction="none") + (
            1 - o.alpha) * mutual_kl(meme, logits, o.kl)
        shared = o.beta * F.cross_entropy(meme, y, reduction="none") + (
            1 - o.beta) * mutual_kl(logits, meme, o.kl)
        return weighted_mean(local + shared, w)
