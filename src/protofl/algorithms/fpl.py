"""FPL, federated prototype learning (Huang et al., CVPR 2023, "Rethinking federated learning
with domain shift: a prototype view"): cluster prototypes and unbiased prototypes.

Clients upload their class prototypes ``p_k[c]`` (class-mean features; ``proto_pass: after``,
default, the class means of the trained model over the client's data as the paper defines
them; ``training`` the mean over the last local epoch's training pass, as the authors' code
collects them). Server, per class c: FINCH (cosine; the coarsest partition, as the authors'
code takes the last column) clusters the uploaded ``p_k[c]`` and the cluster means are the
**cluster prototypes** ``P^c = {q^c_j}`` (one uploaded prototype is its own cluster); the
**unbiased prototype** is their plain mean ``u^c = mean_j q^c_j``. A class no active client
uploaded keeps its previous prototypes. At most ``max_clusters`` per class are kept (the
smallest dropped; 0: the number of clients, so none is).

Client loss ``CE + lam_cpcl L_CPCL + lam_upcr L_UPCR`` on the features z, both terms 0 for a
sample whose class has no global prototype yet:

- ``L_CPCL = -log( sum_{q in P^y} e^{cos(z,q)/tau} / sum_{q in P} e^{cos(z,q)/tau} )`` over the
  cluster prototypes of every class ``P`` (InfoNCE, positives those of class y), tau = 0.02;
- ``L_UPCR = mean_i (z_i - u^y_i)^2`` (MSE to the unbiased prototype; fedproto's regulariser).

Model weights are averaged with FedAvg's weights (the paper's federation shares one model);
the heterogeneous-model variant :class:`PersonalFPL` (``registry.HETEROGENEOUS``; protofl's
adaptation, not the paper's) keeps every client's model and shares only prototypes, scored by
each client's own model. Defaults: lam_cpcl = lam_upcr = 1 and tau = 0.02 (the authors' code:
``loss = CE + InfoNCE + MSE``, ``--infoNCET 0.02``); the client optimizer SGD with momentum
0.9 and weight decay 1e-5 (the authors' ``fpl.py``).

The server needs every client's prototypes (it clusters them): no DP or secure sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from protofl.algorithms.base import (
    Algorithm,
    UploadEntry,
    forward,
    sample_count,
    split_state,
    weighted_mean,
)
from protofl.algorithms.capabilities import Personalized, Prototypes
from protofl.algorithms.fedplvm import ABSENT, cluster_means, masked_mean
from protofl.algorithms.fedproto import (
    PROTO_PASSES,
    client_prototypes,
    pass_sums,
    prototype_regulariser,
)
from protofl.config import option

DEFAULT_CLUSTERS = 8  # max_clusters 0 where the number of clients is not known


@dataclass
class FPLOptions:
    lam_cpcl: float = option(1.0, "weight of the cluster-prototype contrastive loss", ge=0)
    lam_upcr: float = option(1.0, "weight of the MSE to the unbiased prototype", ge=0)
    tau: float = option(0.02, "InfoNCE temperature (the authors' --infoNCET)", gt=0)
    max_clusters: int = option(0, "cluster prototypes kept per class (the smallest beyond "
                                  "are dropped; 0: the number of clients)", ge=0)
    proto_pass: str = option("after", "when a client's prototypes are taken: after (class "
                                      "means of the trained model over its data: the paper) "
                                      "or training (the mean over its last local epoch's "
                                      "training pass: the authors' code)", choices=PROTO_PASSES)


def cluster_nce(z: torch.Tensor, y: torch.Tensor, protos: torch.Tensor, mask: torch.Tensor,
                tau: float) -> torch.Tensor:
    """Per-sample ``L_CPCL`` against cluster prototypes ``protos (C, M, d)`` with ``mask
    (C, M)``; 0 where class y has none."""
    c, m, d = protos.shape
    valid = (mask > 0).reshape(c * m)
    owner = torch.arange(c, device=z.device).repeat_interleave(m)
    cos = F.cosine_similarity(z.unsqueeze(1), protos.reshape(c * m, d).to(z.dtype).unsqueeze(0),
                              dim=2)
    logits = torch.where(valid, cos / tau, torch.full_like(cos, ABSENT))
    pos = valid & (owner.unsqueeze(0) == y.unsqueeze(1))
    loss = torch.logsumexp(logits, 1) - torch.logsumexp(
        torch.where(pos, logits, torch.full_like(logits, ABSENT)), 1)
    return torch.where((mask > 0).any(1)[y], loss, torch.zeros_like(loss))


class FPL(Prototypes, Algorithm):
    name = "fpl"
    description = ("FPL (Huang et al. 2023): FINCH cluster prototypes and unbiased prototypes, "
                   "CE + cluster-prototype InfoNCE + MSE to the unbiased prototype")
    Options = FPLOptions
    client_defaults = {"optimizer": "sgd", "momentum": 0.9, "weight_decay": 1e-5}
    client_defaults_source = ("Huang et al. 2023 (the authors' fpl.py): SGD, momentum 0.9, "
                              "weight decay 1e-5")
    individual_reason = "its server clusters every client's prototypes (FINCH)"

    def clusters(self) -> int:
        """M, the cluster prototypes kept per class."""
        if self.opts.max_clusters:
            return self.opts.max_clusters
        return self.federation.num_clients if self.federation else DEFAULT_CLUSTERS

    def init_state(self, model):
        state = super().init_state(model)
        state["cluster_protos"] = torch.zeros(self.num_classes, self.clusters(),
                                              model.feature_dim)
        state["cluster_mask"] = torch.zeros(self.num_classes, self.clusters())
        return state

    def broadcast(self, state):
        out = super().broadcast(state)
        out.update(cluster_protos=state["cluster_protos"], cluster_mask=state["cluster_mask"])
        return out

    def cluster(self, state, uploads):
        """The next cluster prototypes and mask: FINCH per class over the uploaded
        prototypes of the clients holding it."""
        protos, mask = state["cluster_protos"].clone(), state["cluster_mask"].clone()
        for c in range(self.num_classes):
            rows = [u["protos"][c] for u in uploads if u["counts"][c] > 0]
            if not rows:
                continue  # nobody uploaded class c: keep its previous cluster prototypes
            p, m = cluster_means(torch.stack(rows), protos.shape[1], "last")
            protos[c], mask[c] = p.to(protos.dtype), m.to(mask.dtype)
        return protos, mask

    def aggregate(self, state, uploads, round):
        new, diag = super().aggregate(state, uploads, round)
        new["cluster_protos"], new["cluster_mask"] = self.cluster(state, uploads)
        diag["cluster_prototypes"] = new["cluster_mask"].sum(1).tolist()
        return new, diag

    # ---- client ----
    def client_begin(self, c):
        protos, mask = c.broadcast["cluster_protos"], c.broadcast["cluster_mask"]
        return {"protos": protos, "mask": mask, "unbiased": masked_mean(protos, mask),
                "has": (mask > 0).any(1).to(protos.dtype)}

    def loss_and_features(self, model, params, buffers, x, y, w, ctx):
        z, logits = forward(model, params, buffers, x)
        o = self.opts
        ce = F.cross_entropy(logits, y, reduction="none")
        cpcl = cluster_nce(z, y, ctx["protos"], ctx["mask"], o.tau)
        upcr = prototype_regulariser(z, y, ctx["unbiased"].to(z.dtype), ctx["has"])
        return weighted_mean(ce + o.lam_cpcl * cpcl + o.lam_upcr * upcr, w), z

    def loss(self, model, params, buffers, x, y, w, ctx):
        return self.loss_and_features(model, params, buffers, x, y, w, ctx)[0]

    def loss_and_stats(self, model, params, buffers, x, y, w, ctx):
        loss, z = self.loss_and_features(model, params, buffers, x, y, w, ctx)
        if self.opts.proto_pass != "training":
            return loss, {}
        return loss, pass_sums(z, y, w, self.num_classes)

    def client_end(self, t):
        up, client_state = super().client_end(t)
        up["protos"], up["counts"] = client_prototypes(self, t)
        return up, client_state

    def upload_spec(self):
        spec = super().upload_spec()
        spec.update({"protos": UploadEntry((self.num_classes, self.model.feature_dim)),
                     "counts": UploadEntry((self.num_classes,), count=True)})
        return spec


class PersonalFPL(Personalized, FPL):
    """FPL on heterogeneous models: every client keeps its own model, only prototypes travel."""

    def init_state(self, model):
        params, buffers = split_state(model)
        c, m = self.num_classes, self.clusters()
        return {"init": {"params": params, "buffers": buffers},
                "cluster_protos": torch.zeros(c, m, model.feature_dim),
                "cluster_mask": torch.zeros(c, m)}

    def broadcast(self, state):
        return {"init": state["init"], "cluster_protos": state["cluster_protos"],
                "cluster_mask": state["cluster_mask"]}

    def aggregate(self, state, uploads, round):
        new = dict(state)
        new["cluster_protos"], new["cluster_mask"] = self.cluster(state, uploads)
        return new, {"cluster_prototypes": new["cluster_mask"].sum(1).tolist()}

    def client_end(self, t):
        protos, counts = client_prototypes(self, t)
        up = {"protos": protos, "counts": counts, "num_samples": sample_count(t.y)}
        return up, {"params": t.params, "buffers": t.buffers}

    def upload_spec(self):
        return {"protos": UploadEntry((self.num_classes, self.model.feature_dim)),
                "counts": UploadEntry((self.num_classes,), count=True),
                "num_samples": UploadEntry((), count=True, kind="size")}
