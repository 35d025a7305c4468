"""What every federated algorithm is: a client part and a server part, over plain tensors.

An algorithm never schedules anything. The trainers (sequential, vectorized, compiled,
parallel, Flower) and the round loop call the same hooks (``algorithms/contract.py``)::

    broadcast = alg.broadcast(state)                                    # server -> client
    ctx = alg.client_begin(c)               # c: ClientRound (round, client, broadcast, x, y, ...)
    loss, stats = alg.loss_and_stats(model, params, buffers, x, y, w, ctx)  # vmap-able
    upload, client_state = alg.client_end(t)   # t: TrainedClient (c + params, buffers, ctx, stats)
    state, diagnostics = alg.aggregate(state, uploads, round)           # client -> server

``params``/``buffers`` are name -> tensor dicts of the model; ``w`` weights each sample (1 for
real rows, 0 for padding), so a loss is a weighted mean and padded batches change nothing.
State, contexts and uploads are nested dicts of tensors (typed below per algorithm):
serialisable, checkpointed, and sent as Flower records as they are.

An algorithm also says what the rest of protofl may know about it, so nothing outside it
names its keys: ``upload_spec`` (every upload entry's shape, which are counts, and what each
is: weights, prototypes and the counts weighing them, ... for DP and secure sums; an upload
is at most two levels deep), ``client_weights`` (the model an upload stands for, if it holds
one), ``global_weights`` and ``eval_weights`` (the weights the server evaluates),
``pipeline`` (how its clients batch their data) and ``client_defaults`` (its paper's
local-training settings). What only some methods can do (a server rule of sums over clients
for DP and secure aggregation, uploaded prototypes, personalised models) are capabilities it
inherits and implements (``algorithms/capabilities.py``). Example (FedAvg,
one round, two clients)::

    alg = make_algorithm("fedavg", {}, model, num_classes=10)
    state = alg.init_state(alg.model)
    # ...each client trains from alg.broadcast(state) and returns alg.client_end(t)[0]
    state, diagnostics = alg.aggregate(state, [upload_a, upload_b], round=1)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypedDict

import torch
from torch.func import functional_call

from protofl import device as devices
from protofl import tasks
from protofl.algorithms import prototype_math
from protofl.algorithms.contract import CONTRACT, ClientRound, Tensors, TrainedClient
from protofl.config import build
from protofl.data.pipeline import ClientPipeline
from protofl.errors import ProtoflError
from protofl.models.nets import ProtoNet
from protofl.nested import flatten


class Weights(TypedDict):
    """A model's weights: parameters and buffers by name."""

    params: Tensors
    buffers: Tensors


class WeightsUpload(Weights):
    """FedAvg's upload: the locally trained weights and the client's sample count."""

    num_samples: torch.Tensor


# what an upload entry is, for client-level DP and secure sums (docs/privacy.md)
KINDS = {
    "weights": "model weights, averaged with the client weights (under DP: the update W_k - W^t "
               "is clipped)",
    "prototypes": "vectors (..., d) averaged row by row, weighed by the entry `weighed_by`",
    "counts": "per-row counts weighing prototypes (n_k[c], influence)",
    "presence": "per-row counts of which only n > 0 weighs prototypes (one vote per client)",
    "size": "the client's sample count n_k (FedAvg's client weight)",
    "weight": "an aggregation weight the client computed itself",
    "score": "read by the server only to score the client, never aggregated",
    "other": "anything else (the server needs it from each client individually)",
}


@dataclass(frozen=True)
class UploadEntry:
    """One tensor of a valid upload: its shape, whether it is a count (never negative), what
    it is (a key of ``KINDS``) and, for prototypes, the counts entry that weighs them."""

    shape: tuple[int, ...]
    count: bool = False
    kind: str = "other"
    weighed_by: str = ""


@dataclass
class NoOptions:
    pass


@dataclass(frozen=True)
class FederationInfo:
    """What an algorithm is told of the federation it runs in (read-only)."""

    num_clients: int
    num_classes: int
    # n_k, the training samples of each client (None: not known when the algorithm is built,
    # as in a Flower site federation before its nodes join)
    train_sizes: tuple[int, ...] | None


def split_state(model: torch.nn.Module) -> tuple[Tensors, Tensors]:
    """A model's (parameters, buffers) as detached name -> tensor dicts."""
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    return params, buffers


def forward(model: torch.nn.Module, params: Tensors, buffers: Tensors, x: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z, logits)`` of ``model`` evaluated with the given weights (stateless)."""
    return functional_call(model, {**params, **buffers}, (x,), strict=False)


FEATURE_BATCH = 4096  # rows per forward pass when computing features


@torch.no_grad()
def features(model: torch.nn.Module, params: Tensors, buffers: Tensors, x: torch.Tensor,
             batch: int = FEATURE_BATCH) -> torch.Tensor:
    """The features ``z`` of every row of ``x``, computed ``batch`` rows at a time (fewer where
    the device's free memory holds fewer: ``device.forward_rows``)."""
    if len(x) == 0:
        return torch.empty(0, getattr(model, "feature_dim", 0))
    batch = devices.forward_rows(x.device, x, batch, lambda v: forward(model, params, buffers, v),
                                 model)
    return torch.cat([forward(model, params, buffers, x[i:i + batch])[0]
                      for i in range(0, len(x), batch)])


def class_prototypes(model: ProtoNet, params: Tensors, buffers: Tensors, x: torch.Tensor,
                     y: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Class-mean features of a client's data under the given weights: ``(C, d)``, ``(C,)``
    (per pixel for segmentation labels, whose feature maps are summed a few images at a
    time: a whole client's maps would not fit in memory)."""
    if not tasks.dense(y):
        z, labels = tasks.labelled_features(features(model, params, buffers, x), y)
        return prototype_math.class_means(z, labels, num_classes)
    step = tasks.rows_per_pass(y, FEATURE_BATCH)
    sums = torch.zeros(num_classes, model.feature_dim, device=x.device)
    counts = torch.zeros(num_classes, device=x.device)
    for i in range(0, len(y), step):
        z, labels = tasks.labelled_features(
            features(model, params, buffers, x[i:i + step], step), y[i:i + step])
        s, n = prototype_math.class_sums(z, labels, num_classes)
        sums, counts = sums.to(s.dtype) + s, counts.to(n.dtype) + n
    return sums / counts.clamp_min(1).unsqueeze(1), counts


def sample_count(y: torch.Tensor) -> torch.Tensor:
    """n_k as an upload entry: a float64 scalar."""
    return torch.tensor(float(len(y)), dtype=torch.float64)


def weighted_mean(values: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (values * w).sum() / w.sum().clamp_min(1.0)


def weighted_average(trees: list[Tensors], weights: torch.Tensor) -> Tensors:
    """``sum_k weights[k] * tree_k`` for every floating tensor, added tree by tree in the
    order given (one pass over each, no stacked copy; one multi-tensor operation per tree and
    dtype); integer tensors (BatchNorm's step counters) are taken from the first tree."""
    groups: dict[torch.dtype, list[str]] = {}
    for name, v in trees[0].items():
        if v.is_floating_point():
            groups.setdefault(v.dtype, []).append(name)
    summed: Tensors = {}
    for dtype, names in groups.items():
        w = weights.to(dtype)
        total = torch._foreach_mul([trees[0][n] for n in names], w[0])
        for k in range(1, len(trees)):
            torch._foreach_add_(total, torch._foreach_mul([trees[k][n] for n in names], w[k]))
        summed.update(zip(names, total))
    return {n: summed[n] if n in summed else v.clone() for n, v in trees[0].items()}


def sample_weights(uploads: list[Tensors]) -> torch.Tensor:
    """FedAvg's weights ``n_k / sum n`` (float64)."""
    n = torch.stack([u["num_samples"] for u in uploads]).to(torch.float64)
    return n / n.sum()


class Algorithm:
    """Base: FedAvg's behaviour everywhere; subclasses override what differs."""

    name: ClassVar[str] = "base"
    contract: ClassVar[int] = CONTRACT  # the hook contract it is written for (contract.py)
    description: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions  # a dataclass of declared options (config.option)
    # the paper's settings of `clients.*` keys, used where the config leaves them null, and
    # where they come from (shown by `protofl algorithms --verbose`)
    client_defaults: ClassVar[dict[str, Any]] = {}
    client_defaults_source: ClassVar[str] = ""
    data_defaults: ClassVar[dict[str, Any]] = {}  # `data.*` settings it implies (central: pooled)
    # the tasks (protofl.config.TASKS) its loss and uploads are written for; the engine
    # refuses the others. Per-sample feature terms (contrastive, prototype heads) make an
    # algorithm classification-only.
    tasks: ClassVar[tuple[str, ...]] = ("classification",)
    # why its server needs each client's upload, for a method without the Sums capability
    # (DP and secure sums refuse it with this reason; "": the generic one)
    individual_reason: ClassVar[str] = ""
    # why it cannot train heterogeneous models ("": its server averages model weights); a
    # variant that can is named in algorithms/registry.py:HETEROGENEOUS
    heterogeneous_reason: ClassVar[str] = ""
    # the model groups of a heterogeneous federation (engine/hetero.py sets them; None: one
    # model for every client)
    groups: Any = None

    def __init__(self, options: dict[str, Any], model: ProtoNet, num_classes: int,
                 federation: FederationInfo | None = None):
        self.opts = build(self.Options, dict(options), "algo")
        self.num_classes = num_classes
        # the federation (None when built outside a run: a test, a model inspection)
        self.federation = federation
        self.pipeline = self.client_pipeline()
        self.model = self.wrap_model(model)  # what the trainers and the Flower apps train

    def wrap_model(self, model: ProtoNet) -> ProtoNet:
        """The model the algorithm trains, built once from the plain one by the constructor
        and kept as ``self.model`` (default: unchanged; MOON adds a projection head, fedproin
        learnable prototypes)."""
        return model

    def wrapped(self, model: ProtoNet, kind: type[ProtoNet],
                make: Callable[[ProtoNet], ProtoNet]) -> ProtoNet:
        """``model`` inside a ``kind`` wrapper made by ``make``, for ``wrap_model``: the same
        module on every call (``self.model`` when it wraps ``model``; a wrapper as is)."""
        current = getattr(self, "model", None)
        if isinstance(current, kind) and model in (current, current.backbone):
            return current
        return model if isinstance(model, kind) else make(model)

    def client_pipeline(self) -> ClientPipeline:
        """How clients turn their data into batches (default: shuffled epochs, as stored)."""
        return ClientPipeline()

    def options(self) -> dict[str, Any]:
        """Every option with its value (defaults filled in), for the resolved config."""
        return dataclasses.asdict(self.opts)

    # ---- server side ----
    def init_state(self, model: ProtoNet) -> Tensors:
        params, buffers = split_state(model)
        return {"params": params, "buffers": buffers}

    def broadcast(self, state: Tensors) -> Tensors:
        """What the server sends each active client (default: the global weights)."""
        return {"params": state["params"], "buffers": state["buffers"]}

    def aggregation_weights(self, uploads: list[Tensors], state: Tensors
                            ) -> tuple[torch.Tensor, Tensors]:
        """The weights ``a[k]`` of the clients' models (FedAvg: ``n_k / sum n``) and
        diagnostics."""
        return sample_weights(uploads), {}

    def aggregate(self, state: Tensors, uploads: list[Tensors], round: int
                  ) -> tuple[Tensors, Tensors]:
        """New server state from the valid uploads (at least one) of round ``round``, and
        diagnostics for the metrics line; ``weights`` are the aggregation weights used."""
        a, diag = self.aggregation_weights(uploads, state)
        new = dict(state)
        new["params"] = weighted_average([u["params"] for u in uploads], a)
        new["buffers"] = weighted_average([u["buffers"] for u in uploads], a) if uploads[0].get(
            "buffers") else {}
        return new, {"weights": a.tolist(), **diag}

    def global_weights(self, state: Tensors) -> Weights | None:
        """The aggregate model's weights (None for personalised methods, which have none)."""
        return {"params": state["params"], "buffers": state["buffers"]}

    def eval_weights(self, state: Tensors, client_state: Tensors) -> Weights | None:
        """The weights a client's local test split is scored with: the aggregate model's
        (``capabilities.Personalized``: the client's own)."""
        return self.global_weights(state)

    # ---- client side ----
    def client_begin(self, c: ClientRound) -> Tensors:
        """Per-client constants for the loss (a pytree of tensors)."""
        return {}

    def local_start(self, broadcast: Tensors, client_state: Tensors) -> Weights:
        """The weights local training starts from (default: the global ones; personalised
        methods start from the client's own)."""
        return {"params": broadcast["params"], "buffers": broadcast["buffers"]}

    def loss(self, model: ProtoNet, params: Tensors, buffers: Tensors, x: torch.Tensor,
             y: torch.Tensor, w: torch.Tensor, ctx: Tensors) -> torch.Tensor:
        """Weighted mean local loss: cross-entropy."""
        _, logits = forward(model, params, buffers, x)
        return weighted_mean(tasks.per_sample_cross_entropy(logits, y), w)

    def loss_and_stats(self, model: ProtoNet, params: Tensors, buffers: Tensors,
                       x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, ctx: Tensors
                       ) -> tuple[torch.Tensor, Tensors]:
        """The loss and statistics of the same forward pass (what the trainers call).

        Statistics are a dict of tensors, each a sum over the batch's rows weighted by ``w``
        (padding rows count 0), so they add up across batches. The trainers sum them over
        the client's last pass (the last local epoch; with ``local_steps`` the last
        ``ceil(epoch length / batch size)`` steps) and give the sums to ``client_end`` as
        ``TrainedClient.stats``. Default: the loss and no statistics."""
        return self.loss(model, params, buffers, x, y, w, ctx), {}

    def client_end(self, t: TrainedClient) -> tuple[Tensors, Tensors]:
        """The upload and the client's new persistent state (FedAvg: the trained weights and
        the sample count; the state unchanged)."""
        upload: WeightsUpload = {"params": t.params, "buffers": t.buffers,
                                 "num_samples": sample_count(t.y)}
        return dict(upload), t.state

    # ---- what the rest of protofl may know of an upload ----
    def upload_spec(self) -> dict[str, UploadEntry]:
        """Every tensor a valid upload holds, by flattened key (validates client replies)."""
        params, buffers = split_state(self.model)
        spec = {f"params.{k}": UploadEntry(tuple(v.shape), kind="weights")
                for k, v in params.items()}
        spec.update({f"buffers.{k}": UploadEntry(tuple(v.shape), kind="weights")
                     for k, v in buffers.items()})
        spec["num_samples"] = UploadEntry((), count=True, kind="size")
        return spec

    def server_bytes(self) -> list[tuple[str, Any, int, str]]:
        """What the server rule allocates at once besides the state and the uploads, for the
        memory guard (``protofl/sizes.py``): ``(config key, value, bytes, what)``; none here."""
        return []

    def client_weights(self, upload: Tensors) -> Weights | None:
        """The weights of the model a client trained, as its upload holds them (FFD and other
        feature analyses); None when uploads hold no weights (personalised methods)."""
        return {"params": upload["params"], "buffers": upload["buffers"]}

    # ---- evaluation ----
    def predict(self, model: ProtoNet, params: Tensors, buffers: Tensors, state: Tensors,
                x: torch.Tensor) -> torch.Tensor:
        """Class scores (argmax is the prediction)."""
        return forward(model, params, buffers, x)[1]


def validate_upload(upload: Tensors, spec: dict[str, UploadEntry]) -> None:
    """Raise ProtoflError naming the first problem: a missing key, a wrong shape, NaN/Inf or a
    negative count."""
    flat = flatten(upload)
    for key, entry in spec.items():
        if key not in flat:
            raise ProtoflError(f"upload lacks {key!r}")
        t = flat[key]
        if not isinstance(t, torch.Tensor):
            raise ProtoflError(f"upload {key!r} is not a tensor")
        if tuple(t.shape) != tuple(entry.shape):
            raise ProtoflError(f"upload {key!r} has shape {tuple(t.shape)}, expected "
                               f"{entry.shape}")
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ProtoflError(f"upload {key!r} holds NaN or Inf")
        if entry.count and (t < 0).any():
            raise ProtoflError(f"upload {key!r} holds a negative count")
