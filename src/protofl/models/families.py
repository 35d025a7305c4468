"""Model-heterogeneous federations: which model each client trains, and the preset groups.

``model.per_client: [a, b, ...]`` gives client k the model at position ``k mod n`` of the
list; ``model.family: NAME`` names a preset list (``FAMILIES``), after HtFLlib's "HtFE"
groups (heterogeneous feature extractors; Zhang et al., HtFLlib, KDD 2025). Models share only
the feature size ``d`` (``model.feature_dim``, else the family's, else the first model's
native size): the CNN members end in a fully connected layer of width ``d``; any other model
whose feature size differs is followed by a projection to ``d`` before its own linear head,
HtFLlib's parameter-free adaptive average pooling over the feature vector
(``nn.AdaptiveAvgPool1d(d)`` in its ``BaseHeadSplit``; ``model.projection: pool``) or a
linear layer (``linear``). Every client keeps its own head: no weight is shared, only
``d``-dimensional prototypes.

Clients with the same model name form one group: they start from the same initial weights
(built once, in list order, under the run's seed) and the vectorized trainer stacks them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from protofl.config import ModelConfig
from protofl.errors import ProtoflError
from protofl.models.deeplab import MobileNetV2Encoder
from protofl.models.nets import ConvNet, ProtoNet

PROJECTIONS = ("pool", "linear")
DEFAULT_DIM = 128  # d of a per_client list that starts with a CNN or MLP member

# conv widths of the CNN members (3x3 kernels, each block conv-ReLU-maxpool), then fc d
CNNS: dict[str, tuple[int, ...]] = {
    "cnn1": (16,),
    "cnn2": (32, 64),
    "cnn3": (32, 64, 128),
    "cnn_wide": (64, 128),
}

# name -> (members, feature size d, where it comes from)
FAMILIES: dict[str, tuple[tuple[str, ...], int, str]] = {
    "htfe-cnn": (("cnn1", "cnn2", "cnn3", "cnn_wide"), 128,
                 "CNNs of 1-3 conv blocks and two widths (after HtFLlib's CNN groups; cheap)"),
    "htfe-mixed": (("mlp", "cnn1", "cnn2", "cnn3"), 128,
                   "an MLP and CNNs of 1-3 conv blocks"),
    "htfe-img": (("cnn2", "mobilenetv2", "resnet18", "cnn3"), 512,
                 "HtFE-img-4 as far as protofl has its models: a CNN, MobileNetV2, ResNet-18 "
                 "(GoogLeNet replaced by a 3-block CNN); d = 512 as in HtFLlib"),
    "htfe-mlp": (("mlp", "mlp_small", "mlp_wide", "mlp_deep"), 128,
                 "MLPs of several widths and depths (vector inputs such as Synthetic)"),
}

MLPS: dict[str, tuple[int, ...]] = {
    "mlp_small": (64,),
    "mlp_wide": (512,),
    "mlp_deep": (128, 128, 128),
}


class MobileNetV2Net(ProtoNet):
    """MobileNetV2's stem and 17 bottleneck blocks (output stride 32), global average pooling;
    ``z`` the pooled last-block channels (320 at width 1)."""

    def __init__(self, in_shape: tuple[int, ...], num_classes: int, norm: str = "group",
                 width: float = 1.0):
        super().__init__()
        if len(in_shape) != 3:
            raise ProtoflError(f"mobilenetv2 needs image inputs (C, H, W), got shape {in_shape}")
        self.encoder = MobileNetV2Encoder(in_shape[0], width, 32, norm)
        self.feature_dim = self.encoder.high_channels
        self.classifier = nn.Linear(self.feature_dim, num_classes)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder.features(x).mean(dim=(2, 3))


class Projected(ProtoNet):
    """A model's encoder, a projection of its features to ``dim``, a new linear head."""

    def __init__(self, backbone: ProtoNet, dim: int, num_classes: int, kind: str = "pool"):
        super().__init__()
        if kind not in PROJECTIONS:
            raise ProtoflError(f"config: model.projection = {kind!r}; allowed: "
                               f"{', '.join(PROJECTIONS)}")
        backbone.classifier = nn.Identity()  # its own head is unused
        self.backbone = backbone
        self.project = (nn.AdaptiveAvgPool1d(dim) if kind == "pool"
                        else nn.Linear(backbone.feature_dim, dim))
        self.kind = kind
        self.feature_dim = dim
        self.classifier = nn.Linear(dim, num_classes)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        z = self.backbone.encode(x)
        if self.kind == "pool":
            return self.project(z.unsqueeze(1)).squeeze(1)
        return self.project(z)


def _input_dim(in_shape: tuple[int, ...]) -> int:
    n = 1
    for s in in_shape:
        n *= s
    return n


def _cnn(in_shape: tuple[int, ...], num_classes: int, widths: tuple[int, ...], dim: int
         ) -> ConvNet:
    if len(in_shape) != 3:
        raise ProtoflError(f"the CNN members need image inputs (C, H, W), got shape {in_shape}")
    if min(in_shape[1:]) < 2 ** len(widths):
        raise ProtoflError(f"a CNN of {len(widths)} pooled blocks needs inputs of at least "
                           f"{2 ** len(widths)} px, got {tuple(in_shape[1:])}")
    return ConvNet(in_shape, num_classes, widths, 3, dim)


def member_names() -> list[str]:
    """Every name ``model.per_client`` accepts."""
    from protofl.models.registry import MODELS

    return [*CNNS, *MLPS, "mobilenetv2", *(m for m in MODELS if m != "deeplabv3plus")]


def build_member(name: str, in_shape: tuple[int, ...], num_classes: int, dim: int,
                 cfg: ModelConfig) -> ProtoNet:
    """Model ``name`` with features of size ``dim`` (a CNN or MLP member's last hidden layer,
    else its native features, projected when their size differs)."""
    from protofl.models.nets import Mlp
    from protofl.models.registry import build_model

    if name in CNNS:
        return _cnn(in_shape, num_classes, CNNS[name], dim)
    if name in MLPS:
        return Mlp(_input_dim(in_shape), num_classes, (*MLPS[name], dim))
    if name not in member_names():
        raise ProtoflError(f"config: model.per_client: unknown model {name!r}; allowed: "
                           f"{', '.join(member_names())}")
    if name == "mobilenetv2":
        model: ProtoNet = MobileNetV2Net(tuple(in_shape), num_classes, cfg.norm)
    else:
        model = build_model(name, tuple(in_shape), num_classes, cfg)
    if model.feature_dim == dim or not dim:  # dim 0: the model as it is
        return model
    return Projected(model, dim, num_classes, cfg.projection)


def resolve(cfg: ModelConfig) -> tuple[list[str], int]:
    """The per-position model names and the shared feature size ``d`` a config asks for
    (``model.per_client`` or ``model.family``, one-line errors otherwise)."""
    if cfg.family and cfg.per_client and (cfg.family not in FAMILIES or list(
            cfg.per_client) != list(FAMILIES[cfg.family][0])):  # a resolved config has both
        raise ProtoflError("config: give model.family or model.per_client, not both")
    if cfg.name not in ("auto", "heterogeneous"):
        raise ProtoflError(f"config: model.name = {cfg.name!r} gives every client one model; "
                           "drop it with model.per_client / model.family")
    dim = cfg.feature_dim
    if cfg.family:
        if cfg.family not in FAMILIES:
            raise ProtoflError(f"config: model.family = {cfg.family!r}; allowed: "
                               f"{', '.join(FAMILIES)}")
        names, family_dim, _ = FAMILIES[cfg.family]
        return list(names), dim or family_dim
    names = [str(n) for n in cfg.per_client]
    for n in names:
        if n not in member_names():
            raise ProtoflError(f"config: model.per_client: unknown model {n!r}; allowed: "
                               f"{', '.join(member_names())}")
    return names, dim or 0


@dataclass
class ModelGroups:
    """The distinct models of a heterogeneous federation and which one each client trains."""

    names: list[str]  # per list position (client k trains position k mod len)
    distinct: list[str]  # the groups, in first-appearance order
    models: list[ProtoNet] = field(default_factory=list)  # one per group

    def of(self, client: int) -> int:
        """Client ``client``'s group."""
        return self.distinct.index(self.names[client % len(self.names)])

    def clients(self, group: int, num_clients: int) -> list[int]:
        return [k for k in range(num_clients) if self.of(k) == group]


def build_groups(cfg: ModelConfig, in_shape: tuple[int, ...], num_classes: int,
                 wrap: Callable[[ProtoNet], ProtoNet] = lambda m: m) -> tuple[ModelGroups, int]:
    """Every group's model (built in order under the current torch seed, each passed through
    ``wrap``, e.g. an algorithm's ``wrap_model``) and the shared feature size."""
    names, dim = resolve(cfg)
    if not names:
        raise ProtoflError("config: model.per_client is empty")
    distinct = list(dict.fromkeys(names))
    if not dim:  # the first model's native feature size (built aside: the RNG is kept)
        dim = DEFAULT_DIM
        if distinct[0] not in CNNS and distinct[0] not in MLPS:
            with torch.random.fork_rng():
                dim = build_member(distinct[0], in_shape, num_classes, 0, cfg).feature_dim
    models = [wrap(build_member(n, in_shape, num_classes, dim, cfg)) for n in distinct]
    return ModelGroups(names, distinct, models), dim
