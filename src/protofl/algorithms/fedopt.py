"""FedAdagrad, FedYogi and FedAdam (Reddi et al., "Adaptive Federated Optimization", ICLR
2021, Algorithm 2): the server treats the round's mean client update as a pseudo-gradient.

Clients train as in FedAvg (local SGD at ``clients.lr``, the paper's eta_l). With x the
global weights and y_k client k's, the server forms ``delta = sum_k p_k (y_k - x)`` (p_k =
n_k / sum n, FedAvg's weights) and, per coordinate (m = 0 and v = tau^2 at first),

    m     <- beta1 m + (1 - beta1) delta
    v     <- v + delta^2                                    (FedAdagrad)
    v     <- v - (1 - beta2) delta^2 sign(v - delta^2)      (FedYogi)
    v     <- beta2 v + (1 - beta2) delta^2                  (FedAdam)
    x     <- x + eta m / (sqrt(v) + tau)

with no bias correction (Algorithm 2, which starts from v_{-1} >= tau^2; we take tau^2).
Buffers (BatchNorm statistics) are FedAvg's average. Algorithm 2 writes delta as the plain
mean over the round's clients; we weigh it by n_k as the authors' TFF experiments and
Flower's strategies do, so the rule is a ratio of sums (DP and secure sums apply).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from protofl.algorithms.base import Algorithm
from protofl.algorithms.capabilities import Sums
from protofl.config import TASKS, option

VARIANTS = ("adagrad", "yogi", "adam")
# google-research/federated, optimization/docs/hyperparameters.md: the authors' settings of
# the paper's experiments; the values below are their best for EMNIST character recognition
# (a CNN on 28x28 greyscale images, the task closest to MNIST and Fashion-MNIST)
SOURCE = ("Reddi et al. 2021, the authors' optimization/docs/hyperparameters.md "
          "(google-research/federated): 1 local epoch, and for EMNIST character recognition "
          "batch 20 and client lr 10^-1.5")
CLIENT_DEFAULTS = {"local_epochs": 1, "batch_size": 20, "lr": 10 ** -1.5}


def adaptive_step(variant: str, x: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                  delta: torch.Tensor, eta: float, beta1: float, beta2: float, tau: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One server step of Algorithm 2 on one tensor: the new ``(x, m, v)`` from the
    pseudo-gradient ``delta`` (``variant``: adagrad, yogi or adam)."""
    m = beta1 * m + (1 - beta1) * delta
    sq = delta * delta
    if variant == "adagrad":
        v = v + sq
    elif variant == "yogi":
        v = v - (1 - beta2) * sq * torch.sign(v - sq)
    else:
        v = beta2 * v + (1 - beta2) * sq
    return x + eta * m / (v.sqrt() + tau), m, v


class FedOpt(Sums, Algorithm):
    """The adaptive server optimizers; subclasses name the variant and its defaults."""

    variant: ClassVar[str] = "adam"
    tasks = TASKS
    client_defaults = CLIENT_DEFAULTS
    client_defaults_source = SOURCE

    def init_state(self, model):
        state = super().init_state(model)
        tau2 = self.opts.tau ** 2
        state["m"] = {k: torch.zeros_like(v) for k, v in state["params"].items()}
        state["v"] = {k: torch.full_like(v, tau2) for k, v in state["params"].items()}
        return state

    def aggregate(self, state, uploads, round):
        new, diag = super().aggregate(state, uploads, round)  # the weighted mean, FedAvg's
        o = self.opts
        params, m, v = {}, {}, {}
        for k, x in state["params"].items():
            params[k], m[k], v[k] = adaptive_step(self.variant, x, state["m"][k], state["v"][k],
                                                  new["params"][k] - x, o.eta, o.beta1,
                                                  self.beta2(), o.tau)
        return {**new, "params": params, "m": m, "v": v}, diag

    def beta2(self) -> float:
        """The second-moment decay (FedAdagrad has none)."""
        return self.opts.beta2


@dataclass
class AdagradOptions:
    eta: float = option(0.1, "server learning rate eta (the authors' EMNIST value 10^-1)",
                        gt=0)
    beta1: float = option(0.0, "server momentum beta1 (0: the authors' Keras Adagrad has none)",
                          ge=0, lt=1)
    tau: float = option(0.01, "adaptivity tau: added to sqrt(v); v starts at tau^2 (the "
                        "authors' EMNIST value 10^-2)", gt=0)


@dataclass
class AdamOptions:
    eta: float = option(10 ** -2.5, "server learning rate eta (the authors' EMNIST value "
                        "10^-2.5)", gt=0)
    beta1: float = option(0.9, "first-moment decay beta1 (the authors' experiments)", ge=0,
                          lt=1)
    beta2: float = option(0.999, "second-moment decay beta2 (the authors' experiments: "
                          "Keras's default)", ge=0, lt=1)
    tau: float = option(1e-4, "adaptivity tau: added to sqrt(v); v starts at tau^2 (the "
                        "authors' EMNIST value 10^-4)", gt=0)


class FedAdagrad(FedOpt):
    name = "fedadagrad"
    description = ("FedAdagrad (Reddi et al.): server Adagrad on the mean client update, "
                   "v += delta^2")
    variant = "adagrad"
    Options = AdagradOptions

    def beta2(self) -> float:
        return 0.0


class FedYogi(FedOpt):
    name = "fedyogi"
    description = ("FedYogi (Reddi et al.): server Yogi on the mean client update, "
                   "v -= (1-beta2) delta^2 sign(v - delta^2)")
    variant = "yogi"
    Options = AdamOptions


class FedAdam(FedOpt):
    name = "fedadam"
    description = ("FedAdam (Reddi et al.): server Adam on the mean client update, no bias "
                   "correction")
    variant = "adam"
    Options = AdamOptions
