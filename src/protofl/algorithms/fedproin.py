"""fedproin (Kumar, Garg & Sundaresan 2026, the second seed): learnable prototypes with
feature-divergence and prototype-contrastive regularisers and influence-weighted aggregation.

The model is the user's encoder f_theta plus learnable prototypes ``P (C, M, d)`` (standard
normal init), held together by :class:`PrototypeModel`, whose forward returns ``(z, scores)``
with ``scores[c] = -min_m ||z - P[c, m]||``: the argmax is the nearest-prototype prediction,
so evaluation needs nothing special. The parameter ``prototypes`` is trained jointly with the
encoder.

Client loss ``L = L_task + lambda_FD L_FD + lambda_PC L_PC``:

* ``L_task`` (reconstruction: GLVQ) ``mean sigma(mu / T)``, ``mu = (d+ - d-) / (d+ + d-)``
  with ``d+`` the distance to the nearest prototype of the true class and ``d-`` to the
  nearest of any other class (identity instead of sigma, or the hinge
  ``max(0, d+ - d- + margin)``, selectable);
* ``L_FD = MSE(f_theta(x), f_theta_g(x))`` with the frozen global encoder of this round;
* ``L_PC`` (reconstruction) ``mean_{c,m} max(0, (a - b) / (a + b + eps) + margin)``,
  ``a = ||P^g - P||``, ``b = ||P^prev - P||`` (global prototypes and this client's prototypes
  after its previous participation, both fixed); off until the client has ``P^prev``.
  Option: the MOON-style InfoNCE form with cosine similarity and a temperature.

Influence ``I_k[c, m]``: how many local samples have ``(c, m)`` as nearest prototype (over all
classes), counted over the client's last local epoch as trained (``influence: last_epoch``):
the class-balanced, resampled, augmented batches, each with the weights of its own forward
pass (``loss_and_stats`` returns the counts; the trainers sum them over the last pass, which
with ``local_steps`` is the last ``ceil(epoch length / batch size)`` steps). ``influence:
final`` counts instead every training sample once, unaugmented, with the final local weights
(protofl 0.1.0), which weights a client's prototype of class c by about ``n_{k,c}`` rather
than by the balanced epoch's draws.

Server: the encoder by FedAvg (``n_k``); each prototype by ``sum_k I_k P_k / sum_k I_k``,
keeping the previous global prototype where no client hit it (normalized influence
aggregation, NIA). Local epochs are class-balanced (sample weight ``1 / (C_local n_y)``, with
replacement, ``max_c n_c * C_local`` draws) and images of class c are augmented with
probability ``1 - n_c / n_max``.

Ablations: ``fdl: false``, ``pcl: false``, ``nia: false`` (FedAvg on the prototypes), and
all three off. Local training defaults to the paper's Adam, lr 1e-4, batch 128, E = 5
(``client_defaults``; a config's ``clients.*`` keys win).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TypedDict

import torch
from torch import nn

from protofl.algorithms import prototype_math
from protofl.algorithms.base import (
    Algorithm,
    Tensors,
    UploadEntry,
    features,
    forward,
    weighted_mean,
)
from protofl.algorithms.capabilities import Sums
from protofl.algorithms.moon import contrastive_term
from protofl.algorithms.prototype_math import EPS
from protofl.config import option
from protofl.data.augment import AugmentSpec, adaptive_augment
from protofl.data.pipeline import ClientPipeline, class_balanced, shuffled
from protofl.errors import ProtoflError
from protofl.models.nets import ProtoNet


@dataclass
class ProInOptions:
    prototypes_per_class: int = option(3, "M, learnable prototypes per class", ge=1)
    task: str = option("glvq", "task loss: GLVQ or hinge", choices=("glvq", "hinge"))
    squash: str = option("sigmoid", "GLVQ: sigmoid(mu / T) or the identity mu",
                         choices=("sigmoid", "identity"))
    temperature: float = option(1.0, "T of the GLVQ sigmoid", gt=0)
    hinge_margin: float = option(1.0, "hinge: max(0, d+ - d- + margin)", ge=0)
    lambda_fd: float = option(1.0, "weight of the feature divergence loss", ge=0)
    lambda_pc: float = option(0.1, "weight of the prototype contrastive loss", ge=0)
    pcl_form: str = option("margin", "prototype contrastive loss: margin form or InfoNCE",
                           choices=("margin", "infonce"))
    pcl_margin: float = option(0.5, "margin of the PCL margin form", ge=0)
    pcl_temperature: float = option(0.5, "temperature of the PCL InfoNCE form", gt=0)
    fdl: bool = option(True, "feature divergence loss on (ablation switch)")
    pcl: bool = option(True, "prototype contrastive loss on (ablation switch)")
    nia: bool = option(True, "influence-weighted prototype aggregation (false: prototypes "
                             "averaged by n_k like the encoder)")
    balanced_sampling: bool = option(True, "class-balanced local epochs")
    adaptive_augment: bool = option(True, "augment class c with probability 1 - n_c / n_max")
    flips: bool = option(True, "random flips in the augmentation (off for digits/letters)")
    influence: str = option("last_epoch", "influence counts over the last local epoch as "
                                          "trained, or every sample once with the final weights",
                            choices=("last_epoch", "final"))


class ProInContext(TypedDict):
    global_params: Tensors  # the received weights (frozen): L_FD's encoder and P^g
    global_buffers: Tensors
    prev_prototypes: torch.Tensor  # this client's P after its previous participation (or 0)
    has_prev: torch.Tensor  # 1.0 once the client has previous prototypes


class ProInClientState(TypedDict):
    prev_prototypes: torch.Tensor


class PrototypeModel(ProtoNet):
    """An encoder plus learnable prototypes; ``head(z)`` = minus the distance to each class's
    nearest prototype. Parameters: ``backbone.*`` and ``prototypes``."""

    def __init__(self, backbone: ProtoNet, num_classes: int, per_class: int):
        super().__init__()
        self.backbone = backbone
        self.feature_dim = backbone.feature_dim
        self.prototypes = nn.Parameter(torch.randn(num_classes, per_class,
                                                   backbone.feature_dim))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone.encode(x)

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return -prototype_distances(z, self.prototypes).amin(dim=2)


def prototype_distances(z: torch.Tensor, protos: torch.Tensor) -> torch.Tensor:
    """``||z_i - P[c, m]||`` for ``z (B, d)``, ``protos (C, M, d)``: ``(B, C, M)``."""
    c, m, d = protos.shape
    return prototype_math.pairwise_distance(z, protos.reshape(c * m, d)).reshape(len(z), c, m)


def nearest_distances(dist: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``d+`` (nearest prototype of the true class) and ``d-`` (nearest of any other class)
    from ``dist (B, C, M)``."""
    own = (y.unsqueeze(1) == torch.arange(dist.shape[1], device=y.device)).unsqueeze(2)
    inf = torch.full_like(dist, float("inf"))
    d_plus = torch.where(own, dist, inf).amin(dim=(1, 2))
    d_minus = torch.where(own, inf, dist).amin(dim=(1, 2))
    return d_plus, d_minus


def glvq_loss(d_plus: torch.Tensor, d_minus: torch.Tensor, temperature: float,
              squash: str = "sigmoid") -> torch.Tensor:
    """Per-sample GLVQ cost ``f(mu)``, ``mu = (d+ - d-) / (d+ + d-)``, f = sigma(. / T) or the
    identity."""
    mu = (d_plus - d_minus) / (d_plus + d_minus + EPS)
    return torch.sigmoid(mu / temperature) if squash == "sigmoid" else mu


def hinge_loss(d_plus: torch.Tensor, d_minus: torch.Tensor, margin: float) -> torch.Tensor:
    """Per-sample ``max(0, d+ - d- + margin)``."""
    return torch.clamp_min(d_plus - d_minus + margin, 0.0)


def feature_divergence(z: torch.Tensor, z_global: torch.Tensor) -> torch.Tensor:
    """Per-sample mean squared difference over the d features (MSE when averaged)."""
    return ((z - z_global) ** 2).mean(dim=1)


def prototype_contrast_margin(p: torch.Tensor, p_global: torch.Tensor, p_prev: torch.Tensor,
                              margin: float) -> torch.Tensor:
    """``mean_{c,m} max(0, (a - b) / (a + b + eps) + margin)``, ``a = ||P^g - P||``,
    ``b = ||P^prev - P||``."""
    a = (p_global - p).norm(dim=-1)
    b = (p_prev - p).norm(dim=-1)
    return torch.clamp_min((a - b) / (a + b + EPS) + margin, 0.0).mean()


def prototype_contrast_infonce(p: torch.Tensor, p_global: torch.Tensor, p_prev: torch.Tensor,
                               temperature: float) -> torch.Tensor:
    """MOON's contrastive term applied to prototypes: ``mean_{c,m} -log e^{s_g/tau} /
    (e^{s_g/tau} + e^{s_prev/tau})``, s the cosine similarity of ``P[c, m]`` to its global
    and previous counterparts."""
    d = p.shape[-1]
    return contrastive_term(p.reshape(-1, d), p_global.reshape(-1, d), p_prev.reshape(-1, d),
                            temperature).mean()


def influence_aggregate(protos: torch.Tensor, influence: torch.Tensor, previous: torch.Tensor
                        ) -> torch.Tensor:
    """NIA: ``P^g[c, m] = sum_k I_k[c, m] P_k[c, m] / sum_k I_k[c, m]``; a prototype no client
    hit keeps ``previous``. ``protos (K, C, M, d)``, ``influence (K, C, M)``."""
    k, c, m, d = protos.shape
    flat = prototype_math.aggregate_prototypes(protos.reshape(k, c * m, d),
                                               influence.reshape(k, c * m),
                                               previous.reshape(c * m, d))
    return flat.reshape(c, m, d)


class FedProIn(Sums, Algorithm):
    name = "fedproin"
    description = ("fedproin (Kumar et al. 2026): learnable prototypes, feature-divergence and "
                   "prototype-contrastive losses, influence-weighted prototype aggregation")
    Options = ProInOptions
    client_defaults = {"optimizer": "adam", "lr": 1e-4, "batch_size": 128, "local_epochs": 5}
    client_defaults_source = ("Kumar, Garg & Sundaresan 2026, the reference protocol (as read "
                              "from the authors' code): Adam, lr 1e-4, batch 128, E = 5")

    def wrap_model(self, model: ProtoNet) -> PrototypeModel:
        """The encoder with this algorithm's prototypes (the same module on every call)."""
        return self.wrapped(model, PrototypeModel, lambda m: PrototypeModel(
            m, self.num_classes, self.opts.prototypes_per_class))

    def client_pipeline(self) -> ClientPipeline:
        """Class-balanced epochs and adaptive augmentation (each switchable)."""
        opts = self.opts
        spec = AugmentSpec() if opts.flips else AugmentSpec(hflip=0.0, vflip=0.0)
        return ClientPipeline(
            order=class_balanced if opts.balanced_sampling else shuffled,
            transform=partial(augment_batch, spec=spec) if opts.adaptive_augment else None)

    # ---- server ----
    def aggregate(self, state, uploads, round):
        new, diag = super().aggregate(state, uploads, round)  # encoder (and, without NIA, P) by n_k
        influence = torch.stack([u["influence"] for u in uploads])
        if self.opts.nia:
            params = dict(new["params"])
            params["prototypes"] = influence_aggregate(
                torch.stack([u["params"]["prototypes"] for u in uploads]), influence,
                state["params"]["prototypes"])
            new["params"] = params
        diag["unused_prototypes"] = int((influence.sum(0) == 0).sum())
        return new, diag

    def upload_spec(self):
        spec = super().upload_spec()
        c, m = self.num_classes, self.opts.prototypes_per_class
        spec["influence"] = UploadEntry((c, m), count=True, kind="counts")
        if self.opts.nia:  # the prototypes are averaged by influence, not with the encoder
            spec["params.prototypes"] = UploadEntry((c, m, self.model.feature_dim),
                                                    kind="prototypes", weighed_by="influence")
        return spec

    # ---- client ----
    def client_begin(self, c) -> ProInContext:
        broadcast = c.broadcast
        prev = c.state.get("prev_prototypes")
        has_prev = prev is not None
        return {
            "global_params": {k: v.detach() for k, v in broadcast["params"].items()},
            "global_buffers": {k: v.detach().clone() for k, v in broadcast["buffers"].items()},
            "prev_prototypes": prev if has_prev else torch.zeros_like(
                broadcast["params"]["prototypes"]),
            "has_prev": torch.tensor(1.0 if has_prev else 0.0,
                                     device=broadcast["params"]["prototypes"].device),
        }

    def loss(self, model, params, buffers, x, y, w, ctx):
        return self.objective(model, params, buffers, x, y, w, ctx)[0]

    def loss_and_stats(self, model, params, buffers, x, y, w, ctx):
        """The loss and, with ``influence: last_epoch``, this batch's nearest-prototype
        counts under the weights of this step (``{"influence": (C, M)}``)."""
        total, dist = self.objective(model, params, buffers, x, y, w, ctx)
        if self.opts.influence != "last_epoch":
            return total, {}
        return total, {"influence": prototype_math.nearest_hits(dist.detach(), w)}

    def objective(self, model, params, buffers, x, y, w, ctx
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """``L = L_task + lambda_FD L_FD + lambda_PC L_PC`` and the distances ``(B, C, M)``
        of the batch to every prototype."""
        opts = self.opts
        z, _ = forward(model, params, buffers, x)
        protos = params["prototypes"]
        dist = prototype_distances(z, protos)
        d_plus, d_minus = nearest_distances(dist, y)
        if opts.task == "hinge":
            per_sample = hinge_loss(d_plus, d_minus, opts.hinge_margin)
        else:
            per_sample = glvq_loss(d_plus, d_minus, opts.temperature, opts.squash)
        if opts.fdl and opts.lambda_fd > 0:
            with torch.no_grad():
                z_g, _ = forward(model, ctx["global_params"], ctx["global_buffers"], x)
            per_sample = per_sample + opts.lambda_fd * feature_divergence(z, z_g.detach())
        total = weighted_mean(per_sample, w)
        if opts.pcl and opts.lambda_pc > 0:
            p_g = ctx["global_params"]["prototypes"].detach()
            p_prev = ctx["prev_prototypes"].detach()
            if opts.pcl_form == "infonce":
                pc = prototype_contrast_infonce(protos, p_g, p_prev, opts.pcl_temperature)
            else:
                pc = prototype_contrast_margin(protos, p_g, p_prev, opts.pcl_margin)
            total = total + opts.lambda_pc * ctx["has_prev"].to(pc.dtype) * pc
        return total, dist

    def client_end(self, t):
        """The upload; ``t.stats["influence"]`` are the last epoch's counts (summed by the
        trainer), or with ``influence: final`` the counts are taken here."""
        up, _ = super().client_end(t)
        protos = t.params["prototypes"].detach()
        if self.opts.influence == "last_epoch":
            if "influence" not in t.stats:
                raise ProtoflError("fedproin: influence: last_epoch needs the trainer's "
                                   "last-epoch counts (TrainedClient.stats)")
            up["influence"] = t.stats["influence"].to(protos.dtype)
        else:
            z = features(t.model, t.params, t.buffers, t.x)
            up["influence"] = prototype_math.nearest_prototype_counts(z.to(protos.dtype),
                                                                      protos)
        state: ProInClientState = {"prev_prototypes": protos.clone()}
        return up, dict(state)


def augment_batch(x: torch.Tensor, y: torch.Tensor, gen: torch.Generator,
                  counts: torch.Tensor, spec: AugmentSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """fedproin's adaptive augmentation of a batch (``counts``: the client's class counts)."""
    return adaptive_augment(x, y, counts.to(torch.float32), gen, spec), y
