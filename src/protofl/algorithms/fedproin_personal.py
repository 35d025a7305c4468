"""fedproin for model-heterogeneous federations: personalised encoders, shared prototypes.

What fedproin becomes when clients train different models (``model.per_client`` /
``model.family``; protofl's adaptation, not a setting of the paper): no encoder is averaged
(they differ), so every client keeps its own encoder and head (``Personalized``) and the
server aggregates only the learnable prototypes ``P (C, M, d)``, by normalised influence
(NIA) or, with ``nia: false``, by ``n_k``. A client's round starts from its own encoder (the
common initial weights of its model before its first round) and the global prototypes. The
feature-divergence term ``L_FD`` compares with the client's own encoder as the round began
(the paper's frozen global encoder does not exist here), and ``L_PC`` is unchanged. Each
client is scored with its own encoder and its own prototypes after local training.

State: ``init`` (the common initial weights; per model in a heterogeneous federation, see
``engine/hetero.py``) and ``prototypes``; uploads ``params.prototypes``, ``influence`` and
``num_samples``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from protofl.algorithms.base import UploadEntry, sample_weights, split_state
from protofl.algorithms.capabilities import Personalized, Prototypes
from protofl.algorithms.fedproin import FedProIn, influence_aggregate


class PersonalFedProIn(Personalized, Prototypes, FedProIn):

    def init_state(self, model):
        params, buffers = split_state(model)
        return {"init": {"params": params, "buffers": buffers},
                "prototypes": params["prototypes"].clone()}

    def broadcast(self, state):
        return {"init": state["init"], "prototypes": state["prototypes"]}

    def local_start(self, broadcast, client_state):
        own = client_state if "params" in client_state else broadcast["init"]
        return {"params": {**own["params"], "prototypes": broadcast["prototypes"]},
                "buffers": own["buffers"]}

    def client_begin(self, c):
        return super().client_begin(replace(c, broadcast=self.local_start(c.broadcast, c.state)))

    def client_end(self, t):
        up, state = super().client_end(t)
        upload = {"params": {"prototypes": up["params"]["prototypes"].detach()},
                  "influence": up["influence"], "num_samples": up["num_samples"]}
        return upload, {**state, "params": t.params, "buffers": t.buffers}

    def aggregate(self, state, uploads, round):
        protos = torch.stack([u["params"]["prototypes"] for u in uploads])
        influence = torch.stack([u["influence"] for u in uploads])
        new = dict(state)
        diag: dict = {"unused_prototypes": int((influence.sum(0) == 0).sum())}
        if self.opts.nia:
            new["prototypes"] = influence_aggregate(protos, influence, state["prototypes"])
        else:
            a = sample_weights(uploads)
            new["prototypes"] = (a.to(protos.dtype).reshape(-1, 1, 1, 1) * protos).sum(0)
            diag["weights"] = a.tolist()
        return new, diag

    def upload_spec(self):
        c, m = self.num_classes, self.opts.prototypes_per_class
        kind = ({"kind": "prototypes", "weighed_by": "influence"} if self.opts.nia
                else {"kind": "weights"})
        return {"params.prototypes": UploadEntry((c, m, self.model.feature_dim), **kind),
                "influence": UploadEntry((c, m), count=True, kind="counts"),
                "num_samples": UploadEntry((), count=True, kind="size")}

    def prototypes(self, upload):
        """Per class the influence-weighted mean of its M prototypes, and its total
        influence."""
        p, i = upload["params"]["prototypes"], upload["influence"].to(
            upload["params"]["prototypes"].dtype)
        counts = i.sum(1)
        return (i.unsqueeze(-1) * p).sum(1) / counts.clamp_min(1e-12).unsqueeze(1), counts
