"""FedAvgM (Hsu, Qi and Brown 2019, "Measuring the effects of non-identical data distribution
for federated visual classification"): FedAvg whose server applies momentum to the
averaged update.

With ``a_k = n_k / sum n`` over the round's clients and the pseudo-gradient
``Delta^t = W^t - sum_k a_k W_k``::

    v^{t+1} = beta v^t + Delta^t
    W^{t+1} = W^t - eta v^{t+1}

``beta = 0, eta = 1`` is FedAvg. The paper sweeps beta over {0, 0.7, 0.9, 0.97, 0.99, 0.997}
with the server learning rate eta = 1; 0.9 is the default here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from protofl import option
from protofl.algorithms.base import weighted_average
from protofl.algorithms.fedavg import FedAvg


@dataclass
class Options:
    momentum: float = option(0.9, "beta, the server momentum", ge=0, lt=1)
    server_lr: float = option(1.0, "eta, the server learning rate", gt=0)


class FedAvgM(FedAvg):
    """FedAvgM: FedAvg with server momentum (Hsu et al. 2019)."""

    name = "fedavgm"
    description = "FedAvgM (Hsu et al. 2019): FedAvg's averaged update with server momentum"
    Options = Options

    def init_state(self, model):
        state = super().init_state(model)
        state["velocity"] = {k: torch.zeros_like(v) for k, v in state["params"].items()}
        return state

    def aggregate(self, state, uploads, round):
        new, diag = super().aggregate(state, uploads, round)  # buffers and weights as FedAvg
        beta, eta = self.opts.momentum, self.opts.server_lr
        mean = weighted_average([u["params"] for u in uploads],
                                torch.tensor(diag["weights"], dtype=torch.float64))
        velocity = {k: beta * state["velocity"][k] + (w - mean[k])
                    for k, w in state["params"].items()}
        new["params"] = {k: w - eta * velocity[k] for k, w in state["params"].items()}
        new["velocity"] = velocity
        return new, diag
