"""FedMRL, federated model-heterogeneous Matryoshka representation learning (Yi et al., NeurIPS
2024, "Federated model heterogeneous Matryoshka representation learning"; HtFLlib's ``FedMRL``).

Every client trains, beside its own heterogeneous local model ``F_k`` (``backbone.*``: its
extractor ``F_k^ex`` with features of size d2 and its header ``F_k^hd``; personalised,
clients may train different ones), a copy of a shared homogeneous small model ``G``
(``small.*``: extractor ``G^ex`` with features of size d1 and header ``G^hd: R^d1 -> C``) and
its own representation projector ``P_k`` (``proj.*``, one linear layer ``R^(d1+d2) -> R^d2``,
personalised). For a sample x:

    R  = [G^ex(x), F_k^ex(x)]                    (concatenation, d1 + d2)
    R~ = P_k(R)                                  (the fused representation, d2)
    L  = m_G CE(G^hd(R~[:d1]), y) + m_F CE(F_k^hd(R~), y)

The coarse Matryoshka representation is the first d1 dimensions of ``R~`` (learned by the
global header), the fine one all d2 (learned by the local header); one optimizer trains the
three parts. Only ``G`` (extractor and header) is uploaded; the server averages it with
FedAvg's weights (``lgfedavg``'s rule on the ``small.*`` parameters; ``aggregation:
uniform`` is HtFLlib's plain mean). A client's round starts from its own local model and
projector and the global ``G``. A client is scored with its fused model, the local header on
``R~`` (the paper's "mix-large" inference model, the one the authors' code reports): with its
own trained copy of ``G`` (``eval_small: own``, the authors' code, LipingYi/FedMRL's
``FedMRL_hetero.py``, which scores each client right after its local training) or the latest
global ``G`` (``global``, HtFLlib's ``clientmrl.py``).

``G`` is a copy of the first model (HtFLlib builds its global model from model 0), its
features pooled to d1 by a parameter-free adaptive average (HtFLlib's ``BaseHeadSplit`` with
``feature_dim=sub_feature_dim``), with a new linear header; every client starts from the same
initial ``G``. d1 = ``sub_dim`` (0: d2 // 4, HtFLlib's 128 of d = 512; the authors' script
sets d1 = d2 = 500, and the paper's sensitivity study finds smaller d1 better).

Defaults: m_G = m_F = 1 (the paper's and HtFLlib's plain sum of the two losses), FedAvg's
weights n_k (the authors' code; HtFLlib averages uniformly). Client settings: HtFLlib's (SGD,
lr 0.01, batch 10, E = 1); the authors' script uses SGD with momentum 0.9, weight decay 1e-3,
batch 512, E = 10 and clips each part's gradient norm at 50, which protofl does not.
HtFLlib's ``clientmrl.py`` never saves the trained projector (each round, and its evaluation,
start again from the initial one); protofl keeps it, as the paper and the authors' code do.
Uploads: ``small`` and ``num_samples`` (a sum over clients: DP and secure sums apply, the
small model as model weights).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from protofl.algorithms.base import weighted_mean
from protofl.algorithms.capabilities import Personalized
from protofl.algorithms.lgfedavg import LGFedAvg
from protofl.config import option
from protofl.errors import ProtoflError
from protofl.models.families import Projected
from protofl.models.nets import Beside, ProtoNet

AGGREGATIONS = ("samples", "uniform")
EVAL_SMALL = ("own", "global")


@dataclass
class FedMRLOptions:
    sub_dim: int = option(0, "d1, the homogeneous small model's representation size and the "
                             "coarse Matryoshka prefix (0: d2 // 4, HtFLlib's -sfd 128 of "
                             "d = 512); at most d2", ge=0)
    m_global: float = option(1.0, "m_G, weight of the global header's CE on the first d1 "
                                  "dimensions (paper and HtFLlib: 1)", ge=0)
    m_local: float = option(1.0, "m_F, weight of the local header's CE on all d2 dimensions "
                                 "(paper and HtFLlib: 1)", ge=0)
    aggregation: str = option("samples", "the small model's average: samples (FedAvg's n_k "
                                         "weights, the authors' code) or uniform (HtFLlib's "
                                         "servermrl.py)", choices=AGGREGATIONS)
    eval_small: str = option("own", "the small model a client is scored with: own (its trained "
                                    "copy, the authors' code) or global (the latest aggregate, "
                                    "HtFLlib)", choices=EVAL_SMALL)


class MRLNet(Beside):
    """A client's local model (``backbone``), the homogeneous small model (``small``) and the
    projector (``proj``); ``encode`` is the fused representation ``R~`` (d2), ``head`` the
    local header, so ``(z, logits)`` is the model a client is scored with."""

    def __init__(self, backbone: ProtoNet, small: ProtoNet):
        super().__init__(backbone)
        self.small = small
        self.sub_dim = small.feature_dim
        self.proj = nn.Linear(self.sub_dim + self.feature_dim, self.feature_dim)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([self.small.encode(x), self.backbone.encode(x)], dim=1))

    def forward(self, x: torch.Tensor, with_global: bool = False):
        """``(R~, fine logits)``, and with ``with_global`` the global header's logits on the
        coarse prefix ``R~[:, :d1]``."""
        z = self.encode(x)
        fine = self.backbone.head(z)
        return (z, fine, self.small.head(z[:, :self.sub_dim])) if with_global else (z, fine)


def matryoshka_loss(fine: torch.Tensor, coarse: torch.Tensor, y: torch.Tensor,
                    m_local: float, m_global: float) -> torch.Tensor:
    """Per-sample ``m_F CE(fine, y) + m_G CE(coarse, y)``."""
    return (m_local * F.cross_entropy(fine, y, reduction="none")
            + m_global * F.cross_entropy(coarse, y, reduction="none"))


class FedMRL(LGFedAvg):
    name = "fedmrl"
    description = ("FedMRL (Yi et al. 2024): personalised local models and projectors, a "
                   "shared small model; fused Matryoshka representations, the small model "
                   "averaged (FedAvg)")
    Options = FedMRLOptions
    shared = "small."
    key = "small"
    client_defaults_source = ("HtFLlib (main.py defaults, which its FedMRL uses for all three "
                              "parts): SGD, lr 0.01, batch 10, E = 1")

    def wrap_model(self, model):
        def small(m: ProtoNet) -> Projected:  # the first model's, its features pooled to d1
            d1 = self.opts.sub_dim or max(1, m.feature_dim // 4)
            return Projected(copy.deepcopy(m), d1, self.num_classes, "pool")

        def make(m: ProtoNet) -> MRLNet:
            g = self.shared_copy(m, small)
            if g.feature_dim > m.feature_dim:
                raise ProtoflError(f"fedmrl: algo.sub_dim = {g.feature_dim} exceeds the local "
                                   f"model's feature size d2 = {m.feature_dim}")
            return MRLNet(m, g)

        return self.wrapped(model, MRLNet, make)

    def loss(self, model, params, buffers, x, y, w, ctx):
        _, fine, coarse = functional_call(model, {**params, **buffers}, (x,),
                                          {"with_global": True}, strict=False)
        o = self.opts
        return weighted_mean(matryoshka_loss(fine, coarse, y, o.m_local, o.m_global), w)

    # ---- server: lgfedavg's rule, by n_k or uniform ----
    def aggregate(self, state, uploads, round):
        if self.opts.aggregation == "uniform":
            one = torch.ones((), dtype=torch.float64)
            uploads = [{**u, "num_samples": one} for u in uploads]
        return super().aggregate(state, uploads, round)

    def client_weight(self, upload, state):
        if self.opts.aggregation == "uniform":
            return torch.ones((), dtype=torch.float64)
        return super().client_weight(upload, state)

    def client_weight_bound(self):
        return 1.0 if self.opts.aggregation == "uniform" else None

    def eval_weights(self, state, client_state):
        if self.opts.eval_small == "own":  # the client's model as it trained it
            return Personalized.eval_weights(self, state, client_state)
        return super().eval_weights(state, client_state)
