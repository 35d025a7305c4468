"""What every federated algorithm is: a client part and a server part, over plain tensors.

An algorithm never schedules anything. The engine (sequential or vectorized), and the Flower
apps, call the same four functions::

    glob  = alg.broadcast(state)                                   # server -> client
    ctx   = alg.client_begin(model, glob, client_state, x, y)      # before local training
    loss  = alg.loss(model, params, buffers, x, y, w, ctx)         # functional, vmap-able
    up, client_state = alg.client_end(model, params, buffers, glob, ctx, client_state, x, y)
    state, diag = alg.aggregate(state, uploads)                    # client -> server

``params``/``buffers`` are name -> tensor dicts of the model; ``w`` weights each sample (1 for
real rows, 0 for padding), so a loss is a weighted mean and padded batches change nothing.
State, contexts and uploads are nested dicts of tensors: serialisable, checkpointed, and sent
as Flower records as they are. Example (FedAvg, one round, two clients)::

    alg = make_algorithm("fedavg", {}, model, num_classes=10)
    state = alg.init_state(model)
    # ...each client trains from alg.broadcast(state) and returns alg.client_end(...)[0]
    state, diag = alg.aggregate(state, [up_a, up_b])
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch.func import functional_call

from protofl.algorithms import prototypes as proto_math
from protofl.errors import ProtoflError
from protofl.models.nets import ProtoNet

Tensors = dict[str, Any]  # nested dict of tensors


@dataclasses.dataclass
class NoOptions:
    pass


def split_state(model: torch.nn.Module) -> tuple[Tensors, Tensors]:
    """A model's (parameters, buffers) as detached name -> tensor dicts."""
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    return params, buffers


def forward(model: torch.nn.Module, params: Tensors, buffers: Tensors, x: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z, logits)`` of ``model`` evaluated with the given weights (stateless)."""
    return functional_call(model, {**params, **buffers}, (x,), strict=False)


def weighted_mean(values: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (values * w).sum() / w.sum().clamp_min(1.0)


def weighted_average(trees: list[Tensors], weights: torch.Tensor) -> Tensors:
    """``sum_k weights[k] * tree_k`` for every floating tensor; integer tensors (BatchNorm's
    step counters) are taken from the first tree."""
    out = {}
    for name, first in trees[0].items():
        if first.is_floating_point():
            stacked = torch.stack([t[name] for t in trees])
            w = weights.to(stacked.dtype).reshape(-1, *([1] * first.dim()))
            out[name] = (w * stacked).sum(0)
        else:
            out[name] = first.clone()
    return out


class Algorithm:
    """Base: FedAvg's behaviour everywhere; subclasses override what differs."""

    name: ClassVar[str] = "base"
    description: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    tolerate_partial: ClassVar[bool] = False  # stragglers aggregated (True) or dropped
    sampling: ClassVar[str] = "uniform"  # default client sampling
    personalized: ClassVar[bool] = False  # each client keeps and is evaluated with its own model
    vectorizable: ClassVar[bool] = True  # loss is functional and vmap-safe
    # option range checks, declared by name (see check_options)
    choices: ClassVar[dict[str, tuple[str, ...]]] = {}
    positive: ClassVar[tuple[str, ...]] = ()
    nonnegative: ClassVar[tuple[str, ...]] = ()
    at_least_one: ClassVar[tuple[str, ...]] = ()

    def __init__(self, options: dict[str, Any], model: ProtoNet, num_classes: int):
        from protofl.config import _build  # one validator for configs and options

        self.opts = _build(self.Options, dict(options), f"algo ({self.name})")
        self.check_options()
        self.num_classes = num_classes
        self.model = self.wrap_model(model)  # what the engine and the Flower apps train

    def check_options(self) -> None:
        """Check ``self.opts`` against the class's declared ``choices``, ``positive``,
        ``nonnegative`` and ``at_least_one`` option names; one line naming the first bad one."""
        o = self.opts
        for key, allowed in self.choices.items():
            if getattr(o, key) not in allowed:
                raise ProtoflError(f"algo.{key} = {getattr(o, key)!r}; allowed: "
                                   f"{', '.join(allowed)}")
        for keys, ok, rule in ((self.positive, lambda v: v > 0, "> 0"),
                               (self.nonnegative, lambda v: v >= 0, ">= 0"),
                               (self.at_least_one, lambda v: v >= 1, "an integer >= 1")):
            for key in keys:
                if not ok(getattr(o, key)):
                    raise ProtoflError(f"algo.{key} = {getattr(o, key)} must be {rule}")

    def wrap_model(self, model: ProtoNet) -> ProtoNet:
        """The model the algorithm trains, built once from the plain one by the constructor
        and kept as ``self.model`` (default: unchanged; MOON adds a projection head, fedproin
        learnable prototypes)."""
        return model

    # ---- server side ----
    def init_state(self, model: ProtoNet) -> Tensors:
        params, buffers = split_state(model)
        return {"params": params, "buffers": buffers}

    def broadcast(self, state: Tensors) -> Tensors:
        """What the server sends each active client (default: the global weights)."""
        return {"params": state["params"], "buffers": state["buffers"]}

    def aggregation_weights(self, uploads: list[Tensors], state: Tensors
                            ) -> tuple[torch.Tensor, Tensors]:
        """FedAvg: ``n_k / sum n``."""
        n = torch.stack([u["num_samples"] for u in uploads]).to(torch.float64)
        return n / n.sum(), {}

    def aggregate(self, state: Tensors, uploads: list[Tensors]) -> tuple[Tensors, Tensors]:
        """New server state from the valid uploads of a round (at least one)."""
        a, diag = self.aggregation_weights(uploads, state)
        new = dict(state)
        new["params"] = weighted_average([u["params"] for u in uploads], a)
        new["buffers"] = weighted_average([u["buffers"] for u in uploads], a) if uploads[0][
            "buffers"] else {}
        diag = {"weights": a.tolist(), **diag}
        return new, diag

    # ---- client side ----
    def client_begin(self, model: ProtoNet, glob: Tensors, client_state: Tensors,
                     x: torch.Tensor, y: torch.Tensor) -> Tensors:
        """Per-client constants for the loss (a pytree of tensors)."""
        return {}

    def local_start(self, glob: Tensors, client_state: Tensors) -> Tensors:
        """The weights local training starts from (default: the global ones; personalised
        methods start from the client's own)."""
        return {"params": glob["params"], "buffers": glob["buffers"]}

    def loss(self, model: ProtoNet, params: Tensors, buffers: Tensors, x: torch.Tensor,
             y: torch.Tensor, w: torch.Tensor, ctx: Tensors) -> torch.Tensor:
        """Weighted mean local loss: cross-entropy."""
        _, logits = forward(model, params, buffers, x)
        return weighted_mean(F.cross_entropy(logits, y, reduction="none"), w)

    def client_end(self, model: ProtoNet, params: Tensors, buffers: Tensors, glob: Tensors,
                   ctx: Tensors, client_state: Tensors, x: torch.Tensor, y: torch.Tensor
                   ) -> tuple[Tensors, Tensors]:
        """The upload and the client's new persistent state."""
        return {"params": params, "buffers": buffers,
                "num_samples": torch.tensor(float(len(y)), dtype=torch.float64)}, client_state

    def epoch_order(self, y: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Sample order of one local epoch (default: a fresh permutation)."""
        return torch.randperm(len(y), generator=gen)

    def augment(self, x: torch.Tensor, y: torch.Tensor, gen: torch.Generator,
                ctx: Tensors) -> torch.Tensor:
        """Per-batch data augmentation (default: none); ``ctx`` is the client's context."""
        return x

    # ---- evaluation ----
    def predict(self, model: ProtoNet, params: Tensors, buffers: Tensors, state: Tensors,
                x: torch.Tensor) -> torch.Tensor:
        """Class scores (argmax is the prediction)."""
        return forward(model, params, buffers, x)[1]

    def upload_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every tensor a valid upload holds (used to validate client replies)."""
        params, buffers = split_state(self.model)
        shapes = {f"params.{k}": tuple(v.shape) for k, v in params.items()}
        shapes.update({f"buffers.{k}": tuple(v.shape) for k, v in buffers.items()})
        shapes["num_samples"] = ()
        return shapes


def client_prototypes(model: ProtoNet, params: Tensors, buffers: Tensors, x: torch.Tensor,
                      y: torch.Tensor, num_classes: int, batch: int = 4096
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Class-mean features of a client's data under the given weights: ``(C, d)``, ``(C,)``."""
    with torch.no_grad():
        z = torch.cat([forward(model, params, buffers, x[i:i + batch])[0]
                       for i in range(0, len(x), batch)])
    return proto_math.class_means(z, y, num_classes)


def flatten(tree: Tensors, prefix: str = "") -> dict[str, torch.Tensor]:
    """Nested dict of tensors -> flat ``a.b.c`` keys (for validation and Flower records)."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def validate_upload(upload: Tensors, shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise ProtoflError naming the first problem: a missing key, a wrong shape, NaN/Inf or a
    negative count."""
    flat = flatten(upload)
    for key, shape in shapes.items():
        if key not in flat:
            raise ProtoflError(f"upload lacks {key!r}")
        t = flat[key]
        if not isinstance(t, torch.Tensor):
            raise ProtoflError(f"upload {key!r} is not a tensor")
        if tuple(t.shape) != tuple(shape):
            raise ProtoflError(f"upload {key!r} has shape {tuple(t.shape)}, expected {shape}")
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ProtoflError(f"upload {key!r} holds NaN or Inf")
        if (key == "num_samples" or key.endswith("counts") or key == "influence") and (
                t < 0).any():
            raise ProtoflError(f"upload {key!r} holds a negative count")
