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

from protofl.algorithms import prototype_math
from protofl.algorithms.base import (
    Algorithm,
    Tensors,
    UploadEntry,
    Weights,
    WeightsUpload,
    class_prototypes,
    sample_weights,
)
from protofl.config import option
from protofl.tasks import TASKS


@dataclass
class MarginOptions:
    weights: str = option("attention", "aggregation weights: margin attention, FedAvg's n_k, or "
                                       "fair 1/K' (Table 3 rows 1-2)",
                          choices=("attention", "fedavg", "fair"))
    clues: str = option("both", "margins used: LPM and APM, LPM only or APM only (rows 8-9)",
                        choices=("both", "lpm", "apm"))
    combine: str = option("sum", "sigma(LPM) + sigma(APM), or their product",
                          choices=("sum", "product"))
    reduce: str = option("sum", "class margins summed (the seed) or averaged (avoids "
                                "saturating sigma)", choices=("sum", "mean"))
    score: str = option("margin", "per-class score: the margin d- - d+, or -d+ only (row 7)",
                        choices=("margin", "dplus"))
    normalize: str = option("class", "min-max over each class vector's channels, or per "
                                     "channel across classes", choices=("class", "channel"))
    distance: str = option("euclidean", "prototype distance", choices=("euclidean", "cosine"))


class MarginUpload(WeightsUpload):
    protos: torch.Tensor  # P_k (C, d) after local training
    protos_before: torch.Tensor  # P~_k (C, d) under the received global weights
    counts: torch.Tensor  # n_k[c] (C,)


class MarginState(Weights):
    protos: torch.Tensor  # the aggregate prototypes P^t (C, d); P^0 = 0


def class_scores(p: torch.Tensor, q: torch.Tensor, present_p: torch.Tensor,
                 present_q: torch.Tensor, opts: MarginOptions) -> torch.Tensor:
    """Per-class margin SPM(P, Q), or -d+ for the ``dplus`` ablation (NaN where undefined)."""
    if opts.score == "dplus":
        d_plus, _ = prototype_math.margins(prototype_math.minmax(p, present_p, opts.normalize),
                                           prototype_math.minmax(q, present_q, opts.normalize),
                                           present_p, present_q, opts.distance)
        return -d_plus
    return prototype_math.spm(p, q, present_p, present_q, opts.normalize, opts.distance)


def reduce_classes(scores: torch.Tensor, how: str) -> torch.Tensor:
    """Sum (or mean) of the defined class scores; 0 when none is defined."""
    ok = ~torch.isnan(scores)
    total = torch.where(ok, scores, torch.zeros_like(scores)).sum()
    return total / ok.sum().clamp_min(1) if how == "mean" else total


def attention(lpm: torch.Tensor, apm: torch.Tensor, opts: MarginOptions) -> torch.Tensor:
    """``a~[k]`` from reduced margins ``lpm``, ``apm`` (both ``(K',)``), normalised to sum 1."""
    s_l, s_a = torch.sigmoid(lpm), torch.sigmoid(apm)
    if opts.clues == "lpm":
        raw = s_l
    elif opts.clues == "apm":
        raw = s_a
    else:
        raw = s_l * s_a if opts.combine == "product" else s_l + s_a
    return raw / raw.sum()


class FedMargin(Algorithm):
    name = "fedmargin"
    description = ("fedmargin (Michieli & Ozay, the first seed's 'FedProto'; alias pgfl): "
                   "prototype-margin attention, weighted sampling, partial work tolerated")
    Options = MarginOptions
    client_defaults = {"tolerate_partial": True, "sampling": "weighted"}
    tasks = TASKS  # segmentation: pixel prototypes (labels nearest-downsampled, void dropped)

    def init_state(self, model) -> MarginState:
        return {**super().init_state(model), "protos": torch.zeros(self.num_classes,
                                                                    model.feature_dim)}

    def client_begin(self, model, broadcast, client_state, x, y):
        before, _ = class_prototypes(model, broadcast["params"], broadcast["buffers"], x, y,
                                     self.num_classes)
        return {"protos_before": before}

    def client_end(self, model, params, buffers, broadcast, ctx, client_state, x, y):
        up, client_state = super().client_end(model, params, buffers, broadcast, ctx,
                                              client_state, x, y)
        up["protos"], up["counts"] = class_prototypes(model, params, buffers, x, y,
                                                      self.num_classes)
        up["protos_before"] = ctx["protos_before"]
        return up, client_state

    def margins(self, uploads: list[Tensors], server_protos: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reduced LPM and APM of every upload, ``(K',)`` each."""
        opts = self.opts
        everything = torch.ones(self.num_classes, dtype=torch.bool)
        lpm, apm = [], []
        for u in uploads:
            present = u["counts"] > 0
            p = u["protos"].to(torch.float64)
            lpm.append(reduce_classes(class_scores(
                p, u["protos_before"].to(torch.float64), present, present, opts), opts.reduce))
            apm.append(reduce_classes(class_scores(
                p, server_protos.to(torch.float64), present, everything, opts), opts.reduce))
        return torch.stack(lpm), torch.stack(apm)

    def aggregation_weights(self, uploads, state):
        lpm, apm = self.margins(uploads, state["protos"])
        fedavg = sample_weights(uploads)
        if self.opts.weights == "fedavg":
            a = fedavg
        elif self.opts.weights == "fair":
            a = torch.full_like(fedavg, 1.0 / len(fedavg))
        else:
            a = attention(lpm, apm, self.opts)
        return a, {"lpm": lpm.tolist(), "apm": apm.tolist(), "fedavg_weights": fedavg.tolist()}

    def aggregate(self, state, uploads, round):
        new, diag = super().aggregate(state, uploads, round)
        new["protos"] = prototype_math.aggregate_prototypes(
            torch.stack([u["protos"] for u in uploads]),
            torch.stack([u["counts"] for u in uploads]), state["protos"])
        return new, diag

    def upload_spec(self):
        spec = super().upload_spec()
        d = self.model.feature_dim
        spec.update({"protos": UploadEntry((self.num_classes, d)),
                     "protos_before": UploadEntry((self.num_classes, d)),
                     "counts": UploadEntry((self.num_classes,), count=True)})
        return spec

    def prototypes(self, upload, x, y):
        return upload["protos"], upload["counts"]
