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

Influence ``I_k[c, m]`` (how many local samples have ``(c, m)`` as nearest prototype) is
counted in ``client_end`` over the client's whole training set with the final local weights
(one pass equal to a last epoch without augmentation or resampling; counting inside the
functional loss is not possible). Server: the encoder by FedAvg (``n_k``); each prototype by
``sum_k I_k P_k / sum_k I_k``, keeping the previous global prototype where no client hit it
(normalized influence aggregation, NIA). Local epochs are class-balanced (sample weight
``1 / (C_local n_y)``, with replacement, ``max_c n_c * C_local`` draws) and images of class c
are augmented with probability ``1 - n_c / n_max``.

Ablations: ``fdl: false``, ``pcl: false``, ``nia: false`` (FedAvg on the prototypes), and
all three off. The paper trains with Adam, lr 1e-4 (set ``clients.optimizer``/``clients.lr``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from protofl.algorithms import prototypes as pm
from protofl.algorithms.base import Algorithm, forward, weighted_mean
from protofl.algorithms.moon import contrastive_term
from protofl.data.augment import AugmentSpec, adaptive_augment
from protofl.models.nets import ProtoNet

EPS = 1e-8
CHOICES = {"task": ("glvq", "hinge"), "squash": ("sigmoid", "identity"),
           "pcl_form": ("margin", "infonce")}


@dataclass
class ProInOptions:
    prototypes_per_class: int = 3  # M
    task: str = "glvq"  # glvq | hinge
    squash: str = "sigmoid"  # GLVQ: sigmoid(mu / T) or identity mu
    temperature: float = 1.0  # T of the GLVQ sigmoid
    hinge_margin: float = 1.0  # hinge: max(0, d+ - d- + margin)
    lambda_fd: float = 1.0
    lambda_pc: float = 0.1
    pcl_form: str = "margin"  # margin | infonce
    pcl_margin: float = 0.5
    pcl_temperature: float = 0.5  # InfoNCE form
    fdl: bool = True  # ablation switches
    pcl: bool = True
    nia: bool = True  # false: prototypes averaged by n_k like the encoder
    balanced_sampling: bool = True
    adaptive_augment: bool = True
    flips: bool = True  # random flips in the augmentation (off for digits/letters)


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
    return pm.pairwise_distance(z, protos.reshape(c * m, d)).reshape(len(z), c, m)


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
    flat = pm.aggregate_prototypes(protos.reshape(k, c * m, d), influence.reshape(k, c * m),
                                   previous.reshape(c * m, d))
    return flat.reshape(c, m, d)


def balanced_order(y: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Class-balanced epoch: ``max_c n_c * C_local`` indices drawn with replacement, sample i
    with probability ``1 / (C_local * n_{y_i})``."""
    counts = torch.bincount(y)
    present = counts > 0
    c_local = int(present.sum())
    weights = 1.0 / (c_local * counts[y].to(torch.float64))
    length = int(counts.max()) * c_local
    return torch.multinomial(weights, length, replacement=True, generator=gen)


class FedProIn(Algorithm):
    name = "fedproin"
    description = ("fedproin (Kumar et al. 2026): learnable prototypes, feature-divergence and "
                   "prototype-contrastive losses, influence-weighted prototype aggregation")
    Options = ProInOptions

    choices = CHOICES
    positive = ("temperature", "pcl_temperature")
    nonnegative = ("hinge_margin", "lambda_fd", "lambda_pc", "pcl_margin")
    at_least_one = ("prototypes_per_class",)

    def wrap_model(self, model: ProtoNet) -> PrototypeModel:
        """The encoder with this algorithm's prototypes (the same module on every call)."""
        current = getattr(self, "model", None)
        if isinstance(current, PrototypeModel) and model in (current, current.backbone):
            return current
        if not isinstance(model, PrototypeModel):
            model = PrototypeModel(model, self.num_classes, self.opts.prototypes_per_class)
        return model

    # ---- server ----
    def aggregate(self, state, uploads):
        new, diag = super().aggregate(state, uploads)  # encoder (and, without NIA, P) by n_k
        influence = torch.stack([u["influence"] for u in uploads])
        if self.opts.nia:
            params = dict(new["params"])
            params["prototypes"] = influence_aggregate(
                torch.stack([u["params"]["prototypes"] for u in uploads]), influence,
                state["params"]["prototypes"])
            new["params"] = params
        diag["unused_prototypes"] = int((influence.sum(0) == 0).sum())
        return new, diag

    def upload_shapes(self):
        shapes = super().upload_shapes()
        shapes["influence"] = (self.num_classes, self.opts.prototypes_per_class)
        return shapes

    # ---- client ----
    def client_begin(self, model, glob, client_state, x, y):
        prev = client_state.get("prev_prototypes")
        has_prev = prev is not None
        return {
            "global_params": {k: v.detach() for k, v in glob["params"].items()},
            "global_buffers": {k: v.detach().clone() for k, v in glob["buffers"].items()},
            "prev_prototypes": prev if has_prev else torch.zeros_like(
                glob["params"]["prototypes"]),
            "has_prev": torch.tensor(1.0 if has_prev else 0.0),
            "class_counts": torch.bincount(y, minlength=self.num_classes).to(torch.float32),
        }

    def loss(self, model, params, buffers, x, y, w, ctx):
        o = self.opts
        z, _ = forward(model, params, buffers, x)
        protos = params["prototypes"]
        d_plus, d_minus = nearest_distances(prototype_distances(z, protos), y)
        if o.task == "hinge":
            per_sample = hinge_loss(d_plus, d_minus, o.hinge_margin)
        else:
            per_sample = glvq_loss(d_plus, d_minus, o.temperature, o.squash)
        if o.fdl and o.lambda_fd > 0:
            with torch.no_grad():
                z_g, _ = forward(model, ctx["global_params"], ctx["global_buffers"], x)
            per_sample = per_sample + o.lambda_fd * feature_divergence(z, z_g.detach())
        total = weighted_mean(per_sample, w)
        if o.pcl and o.lambda_pc > 0:
            p_g = ctx["global_params"]["prototypes"].detach()
            p_prev = ctx["prev_prototypes"].detach()
            if o.pcl_form == "infonce":
                pc = prototype_contrast_infonce(protos, p_g, p_prev, o.pcl_temperature)
            else:
                pc = prototype_contrast_margin(protos, p_g, p_prev, o.pcl_margin)
            total = total + o.lambda_pc * ctx["has_prev"].to(pc.dtype) * pc
        return total

    def client_end(self, model, params, buffers, glob, ctx, client_state, x, y):
        up, _ = super().client_end(model, params, buffers, glob, ctx, client_state, x, y)
        protos = params["prototypes"].detach()
        with torch.no_grad():
            z = torch.cat([forward(model, params, buffers, x[i:i + 4096])[0]
                           for i in range(0, len(x), 4096)]) if len(x) else torch.empty(
                0, protos.shape[2])
        up["influence"] = pm.nearest_prototype_counts(z.to(protos.dtype), protos)
        return up, {"prev_prototypes": protos.clone()}

    def epoch_order(self, y, gen):
        if not self.opts.balanced_sampling or len(y) == 0:
            return super().epoch_order(y, gen)
        return balanced_order(y, gen)

    def augment(self, x, y, gen, ctx):
        if not self.opts.adaptive_augment or x.dim() != 4:
            return x
        counts = ctx["class_counts"]
        spec = AugmentSpec() if self.opts.flips else AugmentSpec(hflip=0.0, vflip=0.0)
        return adaptive_augment(x, y, counts, gen, spec)
