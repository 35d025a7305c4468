"""fedmargin (Michieli & Ozay; the first seed's "FedProto"): margin-guided attention.

Each client uploads its weights, its class prototypes after local training (P_k), its
prototypes under the received global weights before training (P~_k) and its class counts.
The server scores every client by how its prototype margins moved, locally
(LPM = SPM(P_k, P~_k)) and against the previous aggregate prototypes (APM = SPM(P_k, P^{t-1})),
and averages the weights with a[k] = sigma(sum LPM) + sigma(sum APM), normalised.

Variant ``scores: client``: every input of a client's score is on the client (the broadcast
W^t and P^{t-1}, its P~_k and P_k), so each client computes its unnormalised attention itself
and uploads it instead of P~_k; the server then needs only sums (secure aggregation) and gets
the same weights, but can no longer check them (docs/privacy.md).

APM's reference set (``apm_reference``): ``reported`` (default) compares with the classes of
P^{t-1} that some client has reported so far (the server state's ``reported`` mask, broadcast
with P^{t-1} when clients score), so a class no client has held yet (still the zero vector of
P^0) is neither a d+ counterpart nor a d- candidate; ``all`` takes every class of P^{t-1},
zero vectors included (protofl 0.1.0).
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
    class_prototypes,
    sample_weights,
)
from protofl.algorithms.capabilities import Prototypes, Sums
from protofl.config import TASKS, option


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
    scores: str = option("server", "who computes the attention: the server from uploaded "
                                   "prototypes (published), or each client itself (secure "
                                   "aggregation; the server cannot check it)",
                         choices=("server", "client"))
    apm_reference: str = option("reported", "APM compares with the aggregate prototypes of the "
                                            "classes some client has reported, or with all "
                                            "(zero vectors of unseen classes included)",
                                choices=("reported", "all"))


class MarginState(Weights):
    protos: torch.Tensor  # the aggregate prototypes P^t (C, d); P^0 = 0
    reported: torch.Tensor  # (C,) 1 for the classes some client has reported so far


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


def raw_attention(lpm: torch.Tensor, apm: torch.Tensor, opts: MarginOptions) -> torch.Tensor:
    """Unnormalised ``a~`` from reduced margins ``lpm``, ``apm`` (any equal shapes): in (0, 2]
    for the sum of both clues, (0, 1] otherwise (``attention_bound``)."""
    s_l, s_a = torch.sigmoid(lpm), torch.sigmoid(apm)
    if opts.clues == "lpm":
        return s_l
    if opts.clues == "apm":
        return s_a
    return s_l * s_a if opts.combine == "product" else s_l + s_a


def reported(state: Tensors) -> torch.Tensor:
    """The classes some client has reported (bool ``(C,)``); a state saved before the mask
    existed (protofl 0.1.0) stands for it with its non-zero prototype rows."""
    if "reported" in state:
        return state["reported"] > 0
    return (state["protos"] != 0).any(dim=1)


def attention_bound(opts: MarginOptions) -> float:
    return 2.0 if opts.clues == "both" and opts.combine == "sum" else 1.0


def attention(lpm: torch.Tensor, apm: torch.Tensor, opts: MarginOptions) -> torch.Tensor:
    """``a~[k]`` from reduced margins ``lpm``, ``apm`` (both ``(K',)``), normalised to sum 1."""
    raw = raw_attention(lpm, apm, opts)
    return raw / raw.sum()


class FedMargin(Prototypes, Sums, Algorithm):
    name = "fedmargin"
    description = ("fedmargin (Michieli & Ozay, the first seed's 'FedProto'; alias pgfl): "
                   "prototype-margin attention, weighted sampling, partial work tolerated")
    Options = MarginOptions
    client_defaults = {"tolerate_partial": True, "sampling": "weighted"}
    tasks = TASKS  # segmentation: pixel prototypes (labels nearest-downsampled, void dropped)
    client_defaults_source = ("the first seed: weighted client sampling, partial work "
                              "tolerated (its optimiser settings are per dataset: configs/)")
    heterogeneous_reason = ("its server averages the clients' model weights (the prototype "
                            "margins only weight that average)")

    @property
    def client_scores(self) -> bool:
        return self.opts.scores == "client"

    def init_state(self, model) -> MarginState:
        return {**super().init_state(model),
                "protos": torch.zeros(self.num_classes, model.feature_dim),
                "reported": torch.zeros(self.num_classes)}

    def reference_classes(self, state: Tensors) -> torch.Tensor:
        """The classes of P^{t-1} APM compares with (a bool mask ``(C,)``)."""
        if self.opts.apm_reference == "all":
            return torch.ones(self.num_classes, dtype=torch.bool)
        return reported(state)

    def broadcast(self, state):
        out = super().broadcast(state)
        if self.client_scores:  # the clients score APM themselves against P^{t-1}
            out["protos"] = state["protos"]
            out["reference"] = self.reference_classes(state).to(state["protos"].dtype)
        return out

    def client_begin(self, c):
        before, _ = class_prototypes(c.model, c.broadcast["params"], c.broadcast["buffers"],
                                     c.x, c.y, self.num_classes)
        return {"protos_before": before}

    def client_end(self, t):
        up, client_state = super().client_end(t)
        up["protos"], up["counts"] = class_prototypes(t.model, t.params, t.buffers, t.x, t.y,
                                                      self.num_classes)
        if self.client_scores:
            lpm, apm = self.scores_of(up["protos"], t.ctx["protos_before"], up["counts"],
                                      t.broadcast["protos"], t.broadcast["reference"] > 0)
            up["attention"] = raw_attention(lpm, apm, self.opts)
        else:
            up["protos_before"] = t.ctx["protos_before"]
        return up, client_state

    def scores_of(self, protos: torch.Tensor, before: torch.Tensor, counts: torch.Tensor,
                  server_protos: torch.Tensor, reference: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """One client's reduced LPM and APM (float64 scalars); APM against the classes
        ``reference`` (a bool mask; default every class) of ``server_protos``."""
        opts = self.opts
        present = counts > 0
        if reference is None:
            reference = torch.ones(self.num_classes, dtype=torch.bool,
                                   device=server_protos.device)
        p = protos.to(torch.float64)
        lpm = reduce_classes(class_scores(p, before.to(torch.float64), present, present, opts),
                             opts.reduce)
        apm = reduce_classes(class_scores(p, server_protos.to(torch.float64), present,
                                          reference, opts), opts.reduce)
        return lpm, apm

    def margins(self, uploads: list[Tensors], server_protos: torch.Tensor,
                reference: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Reduced LPM and APM of every upload, ``(K',)`` each (scores: server)."""
        pairs = [self.scores_of(u["protos"], u["protos_before"], u["counts"], server_protos,
                                reference) for u in uploads]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    def aggregation_weights(self, uploads, state):
        """``client_weight`` normalised over the round's clients; the margins the server
        scores are logged (and, for attention weights, used: scored once)."""
        diag = {"fedavg_weights": sample_weights(uploads).tolist()}
        if not self.client_scores:
            lpm, apm = self.margins(uploads, state["protos"], self.reference_classes(state))
            diag.update(lpm=lpm.tolist(), apm=apm.tolist())
        if not self.client_scores and self.opts.weights == "attention":
            return attention(lpm, apm, self.opts), diag
        raw = torch.stack([self.client_weight(u, state) for u in uploads])
        return raw / raw.sum(), diag

    def client_weight(self, upload, state):
        if self.opts.weights == "fedavg":
            return super().client_weight(upload, state)
        if self.opts.weights == "fair":
            return torch.tensor(1.0, dtype=torch.float64)
        if self.client_scores:
            return upload["attention"].to(torch.float64)
        return raw_attention(*self.scores_of(upload["protos"], upload["protos_before"],
                                             upload["counts"], state["protos"],
                                             self.reference_classes(state)), self.opts)

    def client_weight_bound(self):
        return {"fedavg": None, "fair": 1.0}.get(self.opts.weights, attention_bound(self.opts))

    def aggregate(self, state, uploads, round):
        new, diag = super().aggregate(state, uploads, round)
        return self.with_prototypes(new, state, torch.stack([u["protos"] for u in uploads]),
                                    torch.stack([u["counts"] for u in uploads])), diag

    @staticmethod
    def with_prototypes(new: Tensors, state: Tensors, protos: torch.Tensor,
                        counts: torch.Tensor) -> Tensors:
        """``new`` with P^t aggregated from ``protos (K, C, d)`` weighed by ``counts (K, C)``
        (a class no one holds keeps its prototype) and the classes reported so far."""
        new["protos"] = prototype_math.aggregate_prototypes(protos, counts, state["protos"])
        new["reported"] = (reported(state) | (counts > 0).any(dim=0)).to(new["protos"].dtype)
        return new

    def sums_reason(self):
        if not self.client_scores:
            return ("its server scores each client from the client's own prototypes "
                    "(protos_before); set algo.scores: client")
        return super().sums_reason()

    def aggregate_private(self, state, mean, round):
        """The aggregate model as it is, and P^t from the aggregate prototypes (no scores: the
        weights are already in the estimate)."""
        new = dict(state)
        new["params"], new["buffers"] = mean["params"], mean.get("buffers", {})
        return self.with_prototypes(new, state, mean["protos"].unsqueeze(0),
                                    mean["counts"].unsqueeze(0)), {}

    def upload_spec(self):
        spec = super().upload_spec()
        c, d = self.num_classes, self.model.feature_dim
        spec.update({"protos": UploadEntry((c, d), kind="prototypes", weighed_by="counts"),
                     "counts": UploadEntry((c,), count=True, kind="counts")})
        if self.client_scores:
            spec["attention"] = UploadEntry((), count=True, kind="weight")
        else:
            spec["protos_before"] = UploadEntry((c, d), kind="score")
        return spec

