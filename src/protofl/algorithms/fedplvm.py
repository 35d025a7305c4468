"""FedPLVM (Wang et al., NeurIPS 2024): dual-level prototype clustering and the
alpha-sparsity prototype loss. Model weights are averaged (FedAvg), as in the paper.

Clients: after local training, the features of each class are clustered with FINCH (cosine)
and the cluster means are the client's local prototypes of that class. Server: the uploaded
local prototypes of each class are clustered again with FINCH; the cluster means are the
global prototypes (a class no active client uploaded keeps its previous ones). A variable
number of prototypes per class travels as fixed-shape tensors ``(C, M, d)`` padded with zeros
plus a 0/1 mask ``(C, M)``; ``M`` is ``max_local`` on uploads, ``max_global`` on the server
(clusters beyond it, the smallest, are dropped). The coarsest FINCH partition is used
(``level: last``; ``first`` takes the finest).

Client loss ``CE + lambda (L_alpha + L_corr)`` on the features z, both terms only for samples
whose class has global prototypes:

- ``L_alpha = -log( sum_{p in P^y} e^{s(z,p)/tau} / sum_{p in P} e^{s(z,p)/tau} )`` with the
  alpha-sparse similarity ``s(z, p) = sign(cos) |cos(z, p)|^alpha`` (alpha = 0.25,
  tau = 0.07). RECONSTRUCTION: the paper's equation text was not available here; this is a
  prototype-level contrastive (InfoNCE) loss over all global clustered prototypes, positives
  those of the sample's class, with the cosine raised to the power alpha (|cos| is clamped at
  ``1e-4`` so the gradient stays finite).
- ``L_corr = 2 (cos(z, p_y) - 1)^2`` per sample (the weighted mean over samples is taken with
  the rest of the loss), ``p_y`` the mean of the global prototypes of class y.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from protofl.algorithms import finch
from protofl.algorithms.base import (
    Algorithm,
    UploadEntry,
    Weights,
    features,
    forward,
    weighted_mean,
)
from protofl.config import option

SPARSE_EPS = 1e-4  # |cos| floor inside |cos|^alpha
ABSENT = -1e4  # similarity logit of a padding slot (exp() is 0, no NaN)


@dataclass
class FedPLVMOptions:
    lam: float = option(100.0, "weight of L_alpha + L_corr", ge=0)
    alpha: float = option(0.25, "sparsity exponent", gt=0)
    tau: float = option(0.07, "temperature", gt=0)
    max_local: int = option(8, "prototypes per class a client uploads (at most)", ge=1)
    max_global: int = option(8, "global prototypes per class (at most)", ge=1)
    level: str = option("last", "FINCH partition used: last (coarsest) or first (finest)",
                        choices=("last", "first"))


class PLVMState(Weights):
    global_protos: torch.Tensor  # (C, max_global, d), zero-padded
    global_mask: torch.Tensor  # (C, max_global), 1 for a real prototype


def sparse_similarity(z: torch.Tensor, protos: torch.Tensor, alpha: float) -> torch.Tensor:
    """``sign(cos) |cos|^alpha`` between rows of ``z (B, d)`` and ``protos (P, d)``."""
    cos = F.cosine_similarity(z.unsqueeze(1), protos.unsqueeze(0), dim=2)
    return torch.sign(cos) * cos.abs().clamp_min(SPARSE_EPS) ** alpha


def alpha_loss(z: torch.Tensor, y: torch.Tensor, protos: torch.Tensor, mask: torch.Tensor,
               alpha: float, tau: float) -> torch.Tensor:
    """Per-sample ``L_alpha`` against global prototypes ``protos (C, M, d)`` with ``mask
    (C, M)``; 0 where class y has no prototype."""
    c, m, d = protos.shape
    valid = (mask > 0).reshape(c * m)
    owner = torch.arange(c, device=z.device).repeat_interleave(m)
    logits = sparse_similarity(z, protos.reshape(c * m, d).to(z.dtype), alpha) / tau
    logits = torch.where(valid, logits, torch.full_like(logits, ABSENT))
    pos = valid & (owner.unsqueeze(0) == y.unsqueeze(1))
    loss = torch.logsumexp(logits, 1) - torch.logsumexp(
        torch.where(pos, logits, torch.full_like(logits, ABSENT)), 1)
    has = (mask > 0).any(1)[y]
    return torch.where(has, loss, torch.zeros_like(loss))


def correction_loss(z: torch.Tensor, y: torch.Tensor, mean_protos: torch.Tensor,
                    has: torch.Tensor) -> torch.Tensor:
    """Per-sample ``L_corr = 2 (cos(z, p_y) - 1)^2``; 0 where class y has no prototype."""
    cos = F.cosine_similarity(z, mean_protos[y].to(z.dtype), dim=1)
    loss = 2.0 * (cos - 1.0) ** 2
    return torch.where(has[y] > 0, loss, torch.zeros_like(loss))


def masked_mean(protos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of the valid prototypes of each class ``(C, d)`` (0 where none)."""
    w = mask.to(protos.dtype).unsqueeze(2)
    return (w * protos).sum(1) / w.sum(1).clamp_min(1.0)


def cluster_means(rows: torch.Tensor, limit: int, level: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """FINCH (cosine) on ``rows``: the cluster means zero-padded to ``(limit, d)`` and the
    mask ``(limit,)`` of the real ones (the smallest clusters beyond ``limit`` are dropped)."""
    labels = finch.select(finch.finch(rows, "cosine"), level)
    means, _ = finch.cluster_means(rows, labels, limit)
    protos = torch.zeros(limit, rows.shape[1], dtype=rows.dtype, device=rows.device)
    mask = torch.zeros(limit, dtype=rows.dtype, device=rows.device)
    protos[:len(means)] = means.to(rows.dtype)
    mask[:len(means)] = 1.0
    return protos, mask


def cluster_classes(z: torch.Tensor, y: torch.Tensor, num_classes: int, limit: int,
                    level: str) -> tuple[torch.Tensor, torch.Tensor]:
    """FINCH (cosine) on each class's rows: padded cluster means ``(C, limit, d)`` and the mask
    ``(C, limit)``."""
    protos = torch.zeros(num_classes, limit, z.shape[1], dtype=z.dtype, device=z.device)
    mask = torch.zeros(num_classes, limit, dtype=z.dtype, device=z.device)
    for c in torch.unique(y).tolist():
        protos[c], mask[c] = cluster_means(z[y == c], limit, level)
    return protos, mask


class FedPLVM(Algorithm):
    name = "fedplvm"
    description = ("FedPLVM (Wang et al. 2024): FINCH-clustered local and global prototypes, "
                   "CE + lambda (alpha-sparsity prototype loss + correction); FedAvg weights")
    Options = FedPLVMOptions
    individual_reason = "its server clusters every client's local prototypes (FINCH)"

    def init_state(self, model) -> PLVMState:
        state = super().init_state(model)
        c, m, d = self.num_classes, self.opts.max_global, model.feature_dim
        state["global_protos"] = torch.zeros(c, m, d)
        state["global_mask"] = torch.zeros(c, m)
        return state

    def broadcast(self, state):
        out = super().broadcast(state)
        out.update(global_protos=state["global_protos"], global_mask=state["global_mask"])
        return out

    def aggregate(self, state, uploads, round):
        new, diag = super().aggregate(state, uploads, round)
        protos, mask = state["global_protos"].clone(), state["global_mask"].clone()
        for c in range(self.num_classes):
            rows = torch.cat([u["local_protos"][c][u["local_mask"][c] > 0] for u in uploads])
            if len(rows) == 0:
                continue  # nobody uploaded class c: keep its previous global prototypes
            p, m = cluster_means(rows, self.opts.max_global, self.opts.level)
            protos[c], mask[c] = p.to(protos.dtype), m.to(mask.dtype)
        new["global_protos"], new["global_mask"] = protos, mask
        diag["global_prototypes"] = mask.sum(1).tolist()
        return new, diag

    def client_begin(self, c):
        protos, mask = c.broadcast["global_protos"], c.broadcast["global_mask"]
        return {"protos": protos, "mask": mask, "mean": masked_mean(protos, mask),
                "has": (mask > 0).any(1).to(protos.dtype)}

    def loss(self, model, params, buffers, x, y, w, ctx):
        z, logits = forward(model, params, buffers, x)
        opts = self.opts
        ce = F.cross_entropy(logits, y, reduction="none")
        reg = alpha_loss(z, y, ctx["protos"], ctx["mask"], opts.alpha, opts.tau) + correction_loss(
            z, y, ctx["mean"], ctx["has"])
        return weighted_mean(ce + opts.lam * reg, w)

    def client_end(self, t):
        up, client_state = super().client_end(t)
        z = features(t.model, t.params, t.buffers, t.x)
        up["local_protos"], up["local_mask"] = cluster_classes(
            z, t.y, self.num_classes, self.opts.max_local, self.opts.level)
        up["counts"] = torch.bincount(t.y, minlength=self.num_classes).to(z.dtype)
        return up, client_state

    def upload_spec(self):
        spec = super().upload_spec()
        c, m, d = self.num_classes, self.opts.max_local, self.model.feature_dim
        spec.update({"local_protos": UploadEntry((c, m, d)), "local_mask": UploadEntry((c, m)),
                     "counts": UploadEntry((c,), count=True)})
        return spec
