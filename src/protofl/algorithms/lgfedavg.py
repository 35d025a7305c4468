"""LG-FedAvg (Liang et al. 2020, "Think locally, act globally: federated learning with local
and global representations"; HtFLlib's ``LG``).

Every client keeps its own body, the feature extractor ``f(x)`` (``capabilities.Personalized``;
clients may train different bodies, sharing only the feature size d), and only the head, the
linear classifier ``g(z) = W z + b`` (the ``classifier.*`` parameters of protofl's models), is
shared: the server averages the uploaded heads with FedAvg's weights,
``W^{t+1} = sum_k n_k W_k / sum_k n_k`` over the active clients. A client's round starts from
its own body (the common initial weights of its model the first time) with the global head,
and trains both with plain cross-entropy; it is scored on its own test split with its body and
the global head (HtFLlib evaluates after sending the head; the paper's "local test" model).
The first global head is that of the first model's initial weights (HtFLlib: client 0's).

Defaults: nothing beyond FedAvg's weights; the client settings are HtFLlib's (SGD, lr 0.01,
batch 10, E = 1).

State: ``init`` (the common initial weights) and ``head`` (the global head's parameters);
uploads ``head`` and ``num_samples`` (a sum over clients: DP and secure sums apply, the head
as model weights).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import ClassVar

from protofl.algorithms.base import (
    Algorithm,
    Tensors,
    UploadEntry,
    Weights,
    sample_count,
    sample_weights,
    split_state,
    weighted_average,
)
from protofl.algorithms.capabilities import Personalized, Sums
from protofl.errors import ProtoflError
from protofl.models.nets import ProtoNet

HEAD = "classifier."  # the parameters of a ProtoNet's linear head


def head_of(params: Tensors, prefix: str = HEAD) -> Tensors:
    """The shared part's parameters among a model's (by name: ``prefix*``, the head's
    ``classifier.*`` by default)."""
    return {k: v for k, v in params.items() if k.startswith(prefix)}


class GlobalHead(Personalized):
    """Personalised models of which the parameters named ``shared*`` (the head by default)
    are the server's, kept under ``key`` in state and broadcast: a client trains and is
    scored with its own weights, that part replaced by the global one."""

    shared: ClassVar[str] = HEAD
    key: ClassVar[str] = "head"

    def check_head(self, model) -> Tensors:
        """The model's shared parameters (one line if it has none)."""
        head = head_of(split_state(model)[0], self.shared)
        if not head:
            raise ProtoflError(f"{self.name} shares the model's parameters "  # type: ignore[attr-defined]
                               f"{self.shared}*, which model {type(model).__name__} lacks")
        return head

    def local_start(self, broadcast, client_state):
        own = super().local_start(broadcast, client_state)
        return {"params": {**own["params"], **broadcast[self.key]}, "buffers": own["buffers"]}

    def eval_weights(self, state, client_state):
        if "params" not in client_state:
            return super().eval_weights(state, client_state)
        return {"params": {**client_state["params"], **state[self.key]},
                "buffers": client_state["buffers"]}


class LGFedAvg(GlobalHead, Sums, Algorithm):
    name = "lgfedavg"
    description = ("LG-FedAvg (Liang et al. 2020): clients keep their own bodies, only the "
                   "heads are averaged (FedAvg weights)")
    client_defaults = {"optimizer": "sgd", "lr": 0.01, "batch_size": 10, "local_epochs": 1}
    client_defaults_source = ("HtFLlib (main.py defaults, which its LG uses): SGD, lr 0.01, "
                              "batch 10, E = 1")

    def init_state(self, model):
        params, buffers = split_state(model)
        return {"init": {"params": params, "buffers": buffers},
                self.key: {k: v.clone() for k, v in self.check_head(model).items()}}

    def shared_copy(self, first: ProtoNet,
                    build: Callable[[ProtoNet], ProtoNet] = copy.deepcopy) -> ProtoNet:
        """A fresh copy of a shared model of one architecture for every client (fml's meme,
        fedkd's mentee, fedmrl's small model): ``build`` of the first client model asked
        with, as HtFLlib builds its global model from model 0, with its initial weights."""
        if not hasattr(self, "_shared_model"):
            self._shared_model = build(first)
        return copy.deepcopy(self._shared_model)

    def broadcast(self, state):
        return {"init": state["init"], self.key: state[self.key]}

    def aggregate(self, state, uploads, round):
        a = sample_weights(uploads)
        new = dict(state)
        new[self.key] = weighted_average([u[self.key] for u in uploads], a)
        return new, {"weights": a.tolist()}

    def client_end(self, t):
        up = {self.key: {k: v.detach() for k, v in head_of(t.params, self.shared).items()},
              "num_samples": sample_count(t.y)}
        own: Weights = {"params": t.params, "buffers": t.buffers}
        return up, dict(own)

    def upload_spec(self):
        spec = {f"{self.key}.{k}": UploadEntry(tuple(v.shape), kind="weights")
                for k, v in self.check_head(self.model).items()}
        spec["num_samples"] = UploadEntry((), count=True, kind="size")
        return spec
