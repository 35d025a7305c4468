"""fedmargin (Michieli & Ozay; the first seed's "FedProto"): margin-guided attention.

Each client uploads its weights, its class prototypes after local training (P_k), its
prototypes under the received global weights before training (P~_k) and its class counts.
The server scores every client by how its prototype margins moved, locally
(LPM = SPM(P_k, P~_k)) and against the previous aggregate prototypes (APM = SPM(P_k, P^{t-1})),
and averages the weights with a[k] = sigma(sum LPM) + sigma(sum APM), normalised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protofl.algorithms import prototypes as pm
from protofl.algorithms.base import Algorithm, Tensors, client_prototypes

CHOICES = {
    "weights": ("attention", "fedavg", "fair"),
    "clues": ("both", "lpm", "apm"),
    "combine": ("sum", "product"),
    "reduce": ("sum", "mean"),
    "score": ("margin", "dplus"),
    "normalize": ("class", "channel"),
    "distance": ("euclidean", "cosine"),
}


@dataclass
class MarginOptions:
    weights: str = "attention"  # attention | fedavg (n_k) | fair (1/K'): ablation rows 1-2
    clues: str = "both"  # both | lpm | apm: rows 8-9
    combine: str = "sum"  # sigma(LPM) + sigma(APM), or their product
    reduce: str = "sum"  # sum over classes (the seed) or mean (avoids saturating sigma)
    score: str = "margin"  # margin d- - d+, or dplus: -d+ only (row 7)
    normalize: str = "class"  # min-max over each class vector's channels, or per channel
    distance: str = "euclidean"  # or cosine


def class_scores(p: torch.Tensor, q: torch.Tensor, present_p: torch.Tensor,
                 present_q: torch.Tensor, o: MarginOptions) -> torch.Tensor:
    """Per-class margin SPM(P, Q), or -d+ for the ``dplus`` ablation (NaN where undefined)."""
    if o.score == "dplus":
        d_plus, _ = pm.margins(pm.minmax(p, present_p, o.normalize),
                               pm.minmax(q, present_q, o.normalize), present_p, present_q,
                               o.distance)
        return -d_plus
    return pm.spm(p, q, present_p, present_q, o.normalize, o.distance)


def reduce_classes(scores: torch.Tensor, how: str) -> torch.Tensor:
    """Sum (or mean) of the defined class scores; 0 when none is defined."""
    ok = ~torch.isnan(scores)
    total = torch.where(ok, scores, torch.zeros_like(scores)).sum()
    return total / ok.sum().clamp_min(1) if how == "mean" else total


def attention(lpm: torch.Tensor, apm: torch.Tensor, o: MarginOptions) -> torch.Tensor:
    """``a~[k]`` from reduced margins ``lpm``, ``apm`` (both ``(K',)``), normalised to sum 1."""
    s_l, s_a = torch.sigmoid(lpm), torch.sigmoid(apm)
    if o.clues == "lpm":
        raw = s_l
    elif o.clues == "apm":
        raw = s_a
    else:
        raw = s_l * s_a if o.combine == "product" else s_l + s_a
    return raw / raw.sum()


class FedMargin(Algorithm):
    name = "fedmargin"
    description = ("fedmargin (Michieli & Ozay, the first seed's 'FedProto'; alias pgfl): "
                   "prototype-margin attention, weighted sampling, partial work tolerated")
    Options = MarginOptions
    tolerate_partial = True
    sampling = "weighted"
    choices = CHOICES

    def init_state(self, model):
        state = super().init_state(model)
        state["protos"] = torch.zeros(self.num_classes, model.feature_dim)  # P^0 = 0
        return state

    def client_begin(self, model, glob, client_state, x, y):
        before, _ = client_prototypes(model, glob["params"], glob["buffers"], x, y,
                                      self.num_classes)
        return {"protos_before": before}

    def client_end(self, model, params, buffers, glob, ctx, client_state, x, y):
        up, client_state = super().client_end(model, params, buffers, glob, ctx, client_state,
                                              x, y)
        up["protos"], up["counts"] = client_prototypes(model, params, buffers, x, y,
                                                       self.num_classes)
        up["protos_before"] = ctx["protos_before"]
        return up, client_state

    def margins(self, uploads: list[Tensors], server_protos: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reduced LPM and APM of every upload, ``(K',)`` each."""
        o = self.opts
        everything = torch.ones(self.num_classes, dtype=torch.bool)
        lpm, apm = [], []
        for u in uploads:
            present = u["counts"] > 0
            p = u["protos"].to(torch.float64)
            lpm.append(reduce_classes(class_scores(
                p, u["protos_before"].to(torch.float64), present, present, o), o.reduce))
            apm.append(reduce_classes(class_scores(
                p, server_protos.to(torch.float64), present, everything, o), o.reduce))
        return torch.stack(lpm), torch.stack(apm)

    def aggregation_weights(self, uploads, state):
        lpm, apm = self.margins(uploads, state["protos"])
        n = torch.stack([u["num_samples"] for u in uploads]).to(torch.float64)
        if self.opts.weights == "fedavg":
            a = n / n.sum()
        elif self.opts.weights == "fair":
            a = torch.full_like(n, 1.0 / len(n))
        else:
            a = attention(lpm, apm, self.opts)
        return a, {"lpm": lpm.tolist(), "apm": apm.tolist(),
                   "fedavg_weights": (n / n.sum()).tolist()}

    def aggregate(self, state, uploads):
        new, diag = super().aggregate(state, uploads)
        new["protos"] = pm.aggregate_prototypes(
            torch.stack([u["protos"] for u in uploads]),
            torch.stack([u["counts"] for u in uploads]), state["protos"])
        return new, diag

    def upload_shapes(self):
        shapes = super().upload_shapes()
        d = self.model.feature_dim
        shapes.update({"protos": (self.num_classes, d), "protos_before": (self.num_classes, d),
                       "counts": (self.num_classes,)})
        return shapes
