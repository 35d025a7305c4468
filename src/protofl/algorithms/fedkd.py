"""FedKD (Wu et al., "Communication-efficient federated learning via knowledge distillation",
Nature Communications 13:2032, 2022; HtFLlib's ``FedKD``). The paper's methods text was not
at hand here: the loss and the compression follow the authors' public code (wuch15/FedKD,
``model_bert.py``, ``run.py``) and HtFLlib (``clientkd.py``, ``serverkd.py``), which agree
except where an option says so.

Every client trains, with one optimizer, its own large mentor (``backbone.*``, personalised,
what it is scored with; clients may train different ones), a copy of the small shared mentee
(``mentee.*``) and a private bias-free projection ``W_h`` (``project``: mentee features to the
mentor's size). The mentee is a copy of the first model with its initial weights, as ``fml``'s
meme model (HtFLlib: model 0, or a FedAvgCNN in the families that set ``global_model``, whose
protofl counterparts ``htfe-img-2/4/8`` list ``fedavg_cnn`` first): list the small model
first. Adaptive mutual distillation, the mentor's and the mentee's losses summed, nothing
detached (as both codes train)::

    L = CE_t + CE_s + (KL(p_s || p_t) + KL(p_t || p_s) + 2 MSE(h_t, W_h h_s)) / (CE_t + CE_s)

CE the batch-mean cross-entropies, h the features before each head; every distillation and
hidden loss is divided by the two task losses (floored at 1e-8). ``kl: paper`` (default) sums
each KL over the classes, ``htfllib`` is ``nn.KLDivLoss()``'s mean over them too (both codes).
No attention-map term (the paper's transformers only).

Server: the mentees averaged uniformly (``weighting: uniform``: both codes; ``samples``: n_k).
``svd``: ``update`` (default; the paper's dynamic gradient approximation, the authors'
``run.py``): the client uploads ``W^t + trunc(W_k - W^t)``, the server sends
``W^t + trunc(mean update)``; ``weights`` (HtFLlib): ``trunc(W_k)`` up, ``trunc(mean)`` down;
``off``. ``trunc`` keeps, in every tensor of two or more dimensions, the r largest singular
values, r the smallest with ``sum_{j<=r} s_j^2 >= T sum_j s_j^2`` (where all are needed,
both codes keep none, a bug; protofl keeps all), ``T(t) = t_start + (t_end - t_start)
min(t, energy_rounds) / energy_rounds`` in round t = 1, 2, ... (the authors' schedule;
HtFLlib's lags a round); t_start 0.95, t_end 0.98 (both codes' defaults); ``energy_rounds``
is protofl's (an algorithm does not see the run's length: set it to ``rounds``). Conv weights
are truncated as the ``(out, in*kh*kw)`` matrix (``svd_conv: matrix``, protofl's) or per
``kh x kw`` kernel with one rank (``kernel``, HtFLlib's numpy SVD).

DP and secure sums: the mentee is a weights entry. The client truncates before the privacy
layer clips its update (``trunc(W_k - W^t)``, or ``trunc(W_k) - W^t``) to C and noise is added
to the sum, so the accounting is that of any clipped update (clipping scales it: it stays of
low rank; client-side noise shares are dense, costing the saving, not the privacy); the
server's truncation of the noised mean is post-processing. Uniform weights are bounded by 1.

Not reproduced: HtFLlib's separate mentee learning rate (``-mlr``, 0.01 as ``-lr``) and its
gradient clipping at 10. State: ``init``, ``mentee`` and ``energy`` (the next round's T,
broadcast); uploads ``mentee`` and ``num_samples``; the metrics line logs ``energy`` and
``download_fraction`` (floats of the factors sent down over the mentee's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from protofl.algorithms.base import (
    Tensors,
    Weights,
    sample_count,
    sample_weights,
    weighted_average,
    weighted_mean,
)
from protofl.algorithms.lgfedavg import LGFedAvg, head_of
from protofl.config import option
from protofl.models.nets import Beside, ProtoNet

KL_FORMS = ("paper", "htfllib")
SVD_FORMS = ("update", "weights", "off")
CONV_FORMS = ("matrix", "kernel")
WEIGHTINGS = ("uniform", "samples")
EPS = 1e-8  # the adaptive weight's denominator at least this (an all-padding batch: 0 / EPS)


@dataclass
class FedKDOptions:
    kl: str = option("paper", "the KL terms: paper (summed over the classes) or htfllib "
                              "(nn.KLDivLoss()'s mean over the classes too: HtFLlib and the "
                              "authors' code)", choices=KL_FORMS)
    weighting: str = option("uniform", "mentee averaging weights: uniform (HtFLlib and the "
                                       "authors' code) or samples (n_k)", choices=WEIGHTINGS)
    svd: str = option("update", "SVD compression of the shared mentee: update (the update "
                                "W_k - W^t up and the mean update down: the paper), weights (the "
                                "weights themselves: HtFLlib) or off", choices=SVD_FORMS)
    svd_conv: str = option("matrix", "a conv weight (out, in, kh, kw) truncated as the "
                                     "(out, in*kh*kw) matrix or per kh x kw kernel with one "
                                     "rank (kernel: HtFLlib)", choices=CONV_FORMS)
    t_start: float = option(0.95, "energy threshold T of the first round (HtFLlib's -Ts, the "
                                  "authors' --tmin)", gt=0, le=1)
    t_end: float = option(0.98, "energy threshold T from round energy_rounds on (HtFLlib's -Te, "
                                "the authors' --tmax)", gt=0, le=1)
    energy_rounds: int = option(50, "rounds over which T grows linearly from t_start to t_end "
                                    "(set it to the run's rounds)", ge=1)


class FedKDNet(Beside):
    """A client's mentor (``backbone``), the mentee (``mentee``) and the projection ``W_h``
    (``project``) of mentee features to the mentor's."""

    def __init__(self, backbone: ProtoNet, mentee: ProtoNet):
        super().__init__(backbone)
        self.mentee = mentee
        self.project = nn.Linear(mentee.feature_dim, backbone.feature_dim, bias=False)

    def forward(self, x: torch.Tensor, with_mentee: bool = False):
        """``(z, logits)`` of the mentor; with ``with_mentee`` also ``W_h z_s`` and the mentee's
        logits."""
        z, logits = self.backbone(x)
        if not with_mentee:
            return z, logits
        z_s, logits_s = self.mentee(x)
        return z, logits, self.project(z_s), logits_s


def kl_divergence(target: torch.Tensor, logits: torch.Tensor, form: str) -> torch.Tensor:
    """Per-sample ``KL(softmax(target) || softmax(logits))``, summed over the classes
    (``paper``) or averaged over them (``htfllib``); gradients reach both arguments."""
    log_p = F.log_softmax(target, dim=1)
    kl = (log_p.exp() * (log_p - F.log_softmax(logits, dim=1))).sum(1)
    return kl / logits.shape[1] if form == "htfllib" else kl


def mutual_distillation(logits_t: torch.Tensor, logits_s: torch.Tensor, h_t: torch.Tensor,
                        h_s: torch.Tensor, y: torch.Tensor, w: torch.Tensor, form: str
                        ) -> torch.Tensor:
    """FedKD's adaptive mutual distillation loss ``L_t + L_s`` of a batch (rows weighted by
    ``w``): ``h_s`` is the mentee's features already projected by ``W_h``."""
    ce_t = weighted_mean(F.cross_entropy(logits_t, y, reduction="none"), w)
    ce_s = weighted_mean(F.cross_entropy(logits_s, y, reduction="none"), w)
    kl = weighted_mean(kl_divergence(logits_s, logits_t, form)
                       + kl_divergence(logits_t, logits_s, form), w)
    hidden = weighted_mean(((h_t - h_s) ** 2).mean(1), w)
    return ce_t + ce_s + (kl + 2 * hidden) / (ce_t + ce_s).clamp_min(EPS)


def energy_rank(s: torch.Tensor, energy: float) -> int:
    """The number r of singular values kept: the smallest with ``sum_{j<r} s_j^2 >= energy *
    sum_j s_j^2``, ``s (..., K)`` summed over its leading (kernel) dimensions."""
    s2 = (s.to(torch.float64) ** 2).reshape(-1, s.shape[-1]).sum(0)
    below = (s2.cumsum(0) < energy * s2.sum()).sum()
    return min(int(below) + 1, s2.numel())


def truncate(t: torch.Tensor, energy: float, conv: str = "matrix") -> tuple[torch.Tensor, int]:
    """``t`` with its SVD truncated at ``energy`` (:func:`energy_rank`), and the floats its
    factors take (``t.numel()`` when left whole: under two dimensions, a matrix side of one,
    or all zero). A tensor of more than two dimensions is the ``(t.shape[0], -1)`` matrix
    (``matrix``) or a batch of matrices over its last two dimensions (``kernel``)."""
    if t.dim() < 2:
        return t, t.numel()
    m = t.reshape(t.shape[0], -1) if conv == "matrix" else t
    if min(m.shape[-2:]) < 2 or not bool(m.any()):
        return t, t.numel()
    u, s, vh = torch.linalg.svd(m.to(torch.float64), full_matrices=False)
    r = energy_rank(s, energy)
    out = (u[..., :r] * s[..., None, :r]) @ vh[..., :r, :]
    batch = m[..., 0, 0].numel()
    return out.reshape(t.shape).to(t.dtype), batch * r * (m.shape[-2] + m.shape[-1] + 1)


def compress(tree: Tensors, energy: float, conv: str) -> tuple[Tensors, int]:
    """Every tensor of ``tree`` truncated (:func:`truncate`) and the floats sent in all."""
    out, floats = {}, 0
    for k, v in tree.items():
        out[k], n = truncate(v, energy, conv)
        floats += n
    return out, floats


class FedKD(LGFedAvg):
    name = "fedkd"
    description = ("FedKD (Wu et al. 2022): personalised mentors and a shared small mentee "
                   "trained by adaptive mutual distillation; mentee updates SVD-compressed")
    Options = FedKDOptions
    shared = "mentee."
    key = "mentee"
    client_defaults = {"optimizer": "sgd", "lr": 0.01, "batch_size": 10, "local_epochs": 1}
    client_defaults_source = ("HtFLlib (main.py defaults, which its FedKD uses for the mentor "
                              "and W_h; its mentee's -mlr is also 0.01): SGD, lr 0.01, batch 10, "
                              "E = 1")

    def wrap_model(self, model):
        return self.wrapped(model, FedKDNet, lambda m: FedKDNet(m, self.shared_copy(m)))

    def energy(self, round: int) -> float:
        """The energy threshold T(t) of round ``round`` (1, 2, ...)."""
        o = self.opts
        return o.t_start + (o.t_end - o.t_start) * min(round, o.energy_rounds) / o.energy_rounds

    # ---- server ----
    def init_state(self, model):
        state = super().init_state(model)
        state["energy"] = torch.tensor(self.energy(1), dtype=torch.float64)
        return state

    def broadcast(self, state):
        return {**super().broadcast(state), "energy": state["energy"]}

    def client_weight(self, upload, state):
        if self.opts.weighting == "uniform":
            return torch.tensor(1.0, dtype=torch.float64)
        return super().client_weight(upload, state)

    def client_weight_bound(self):
        return 1.0 if self.opts.weighting == "uniform" else None

    def aggregate(self, state, uploads, round):
        k = len(uploads)
        a = (torch.full((k,), 1.0 / k, dtype=torch.float64,
                        device=uploads[0]["num_samples"].device)
             if self.opts.weighting == "uniform" else sample_weights(uploads))
        mean = weighted_average([u[self.key] for u in uploads], a)
        old, e, svd = state[self.key], self.energy(round), self.opts.svd
        full = sum(v.numel() for v in mean.values())
        floats = full
        if svd == "update":
            delta, floats = compress({n: mean[n] - old[n] for n in mean}, e, self.opts.svd_conv)
            mean = {n: old[n] + delta[n] for n in mean}
        elif svd == "weights":
            mean, floats = compress(mean, e, self.opts.svd_conv)
        new = dict(state)
        new[self.key] = mean
        new["energy"] = torch.full_like(state["energy"], self.energy(round + 1))
        return new, {"weights": a.tolist(), "energy": e, "download_fraction": floats / full}

    # ---- client ----
    def loss(self, model, params, buffers, x, y, w, ctx):
        z, logits, h_s, logits_s = functional_call(model, {**params, **buffers}, (x,),
                                                   {"with_mentee": True}, strict=False)
        return mutual_distillation(logits, logits_s, z, h_s, y, w, self.opts.kl)

    def client_end(self, t):
        mentee = {k: v.detach() for k, v in head_of(t.params, self.shared).items()}
        e, conv = float(t.broadcast["energy"]), self.opts.svd_conv
        if self.opts.svd == "update":
            base = {k: t.broadcast[self.key][k].to(v.device, v.dtype) for k, v in mentee.items()}
            delta, _ = compress({k: v - base[k] for k, v in mentee.items()}, e, conv)
            mentee = {k: base[k] + delta[k] for k in mentee}
        elif self.opts.svd == "weights":
            mentee, _ = compress(mentee, e, conv)
        up = {self.key: mentee, "num_samples": sample_count(t.y)}
        own: Weights = {"params": t.params, "buffers": t.buffers}
        return up, dict(own)

