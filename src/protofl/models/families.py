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

A member ``NAME+head:H1-H2`` is model ``NAME`` with an MLP head instead of the linear one:
``d -> H1 -> H2 -> classes``, ReLU between (HtFLlib's ``Head(hidden_dims=[d, H1, H2])``, its
"HtC" heterogeneous classifiers). Members that share ``NAME`` share the extractor's initial
weights (HtFLlib builds every client's model after ``torch.manual_seed(0)``); only the heads
differ. HtFLlib's ``Head`` also puts a ReLU after the class layer; protofl's logits stay
linear.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from protofl import plugins
from protofl.config import ModelConfig
from protofl.errors import ProtoflError
from protofl.models.deeplab import ConvNormAct, MobileNetV2Encoder, divisible
from protofl.models.nets import ConvNet, ProtoNet

PROJECTIONS = ("pool", "linear")
MOBILENETS = {"mobilenetv2": 0, "mobilenetv2_1280": 1280}  # name -> last 1x1 conv width
DEFAULT_DIM = 128  # d of a per_client list that starts with a CNN or MLP member

# conv widths of the CNN members (3x3 kernels, each block conv-ReLU-maxpool), then fc d
CNNS: dict[str, tuple[int, ...]] = {
    "cnn1": (16,),
    "cnn2": (32, 64),
    "cnn3": (32, 64, 128),
    "cnn_wide": (64, 128),
}

HEAD_SEP = "+head:"  # NAME+head:H1-H2: model NAME with the MLP head d -> H1 -> H2 -> classes
# HtFLlib's HtC-img-4 heads, Head(hidden_dims=[512]), [512, 512], [512, 256], [512, 128]
# (the first entry is d): the linear head, then one hidden layer of 512, 256, 128
HTC_HEADS = ("", f"{HEAD_SEP}512", f"{HEAD_SEP}256", f"{HEAD_SEP}128")
HTFE_IMG_8 = ("fedavg_cnn", "googlenet", "mobilenetv2_1280", "resnet18", "resnet34", "resnet50",
              "resnet101", "resnet152")

# name -> (members, feature size d, where it comes from)
FAMILIES: dict[str, tuple[tuple[str, ...], int, str]] = {
    "htfe-cnn": (("cnn1", "cnn2", "cnn3", "cnn_wide"), 128,
                 "CNNs of 1-3 conv blocks and two widths (after HtFLlib's CNN groups; cheap)"),
    "htfe-mixed": (("mlp", "cnn1", "cnn2", "cnn3"), 128,
                   "an MLP and CNNs of 1-3 conv blocks"),
    "htfe-img": (("cnn2", "mobilenetv2", "resnet18", "cnn3"), 512,
                 "protofl's earlier stand-in for HtFE-img-4 (a CNN, MobileNetV2 without its "
                 "1280 conv, ResNet-18, a 3-block CNN), kept so that its runs still resolve; "
                 "htfe-img-4 is HtFLlib's group"),
    "htfe-mlp": (("mlp", "mlp_small", "mlp_wide", "mlp_deep"), 128,
                 "MLPs of several widths and depths (vector inputs such as Synthetic)"),
    # HtFLlib's image groups (system/main.py, model_family), d = 512 (its scripts' feature_dim)
    "htfe-img-2": (("fedavg_cnn", "resnet18"), 512,
                   "HtFLlib's HtFE-img-2: FedAvgCNN, ResNet-18"),
    "htfe-img-3": (("resnet10", "resnet18", "resnet34"), 512,
                   "HtFLlib's HtFE-img-3: ResNet-10, -18, -34"),
    "htfe-img-4": (("fedavg_cnn", "googlenet", "mobilenetv2_1280", "resnet18"), 512,
                   "HtFLlib's HtFE-img-4: FedAvgCNN, GoogLeNet, MobileNetV2, ResNet-18"),
    "htfe-img-5": (("googlenet", "mobilenetv2_1280", "resnet18", "resnet34", "resnet50"), 512,
                   "HtFLlib's HtFE-img-5: GoogLeNet, MobileNetV2, ResNet-18, -34, -50"),
    "htfe-img-8": (HTFE_IMG_8, 512,
                   "HtFLlib's HtFE-img-8: FedAvgCNN, GoogLeNet, MobileNetV2, ResNet-18, -34, "
                   "-50, -101, -152 (the last two heavy on a CPU)"),
    "htc-img-4": (tuple(f"resnet34{h}" for h in HTC_HEADS), 512,
                  "HtFLlib's Res34-HtC-img-4: one ResNet-34 extractor (shared initial weights), "
                  "four heads d -> C, d -> 512 -> C, d -> 256 -> C, d -> 128 -> C"),
    "htfe-img-8-htc-img-4": (tuple(m + HTC_HEADS[k % len(HTC_HEADS)]
                                   for k, m in enumerate(HTFE_IMG_8)), 512,
                             "HtFLlib's HtFE-img-8-HtC-img-4: client k has HtFE-img-8's model "
                             "k mod 8 and HtC-img-4's head k mod 4 (8 pairs)"),
}

MLPS: dict[str, tuple[int, ...]] = {
    "mlp_small": (64,),
    "mlp_wide": (512,),
    "mlp_deep": (128, 128, 128),
}


class MobileNetV2Net(ProtoNet):
    """MobileNetV2's stem and 17 bottleneck blocks (output stride 32), then (``last``, as the
    classification network of torchvision and HtFLlib: member ``mobilenetv2_1280``) a 1x1
    conv to 1280 channels, global average pooling; ``z`` the pooled channels (320 or 1280 at
    width 1)."""

    def __init__(self, in_shape: tuple[int, ...], num_classes: int, norm: str = "group",
                 width: float = 1.0, last: int = 0):
        super().__init__()
        if len(in_shape) != 3:
            raise ProtoflError(f"mobilenetv2 needs image inputs (C, H, W), got shape {in_shape}")
        self.encoder = MobileNetV2Encoder(in_shape[0], width, 32, norm)
        self.feature_dim = self.encoder.high_channels
        self.last = nn.Identity()
        if last:
            c = divisible(last * max(1.0, width))
            self.last = ConvNormAct(self.feature_dim, c, 1, norm)
            self.feature_dim = c
        self.classifier = nn.Linear(self.feature_dim, num_classes)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.encoder.features(x)).mean(dim=(2, 3))


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
    """Every model name ``model.per_client`` accepts (each also as ``NAME+head:H1-H2``)."""
    from protofl.models.registry import model_names

    return [*CNNS, *MLPS, *MOBILENETS, *(m for m in model_names() if m != "deeplabv3plus")]


def split_member(name: str) -> tuple[str, tuple[int, ...] | None]:
    """``(model name, hidden widths of its MLP head or None: linear)``; one-line errors for an
    unknown model or a malformed head."""
    base, sep, spec = name.partition(HEAD_SEP)
    if base not in member_names() and not plugins.is_path(base):
        raise ProtoflError(f"config: model.per_client: unknown model {base!r}; allowed: "
                           f"{', '.join(member_names())} (each also as NAME{HEAD_SEP}H1-H2)")
    if not sep:
        return base, None
    widths = spec.split("-")
    if not all(w.isdigit() and int(w) > 0 for w in widths):
        raise ProtoflError(f"config: model.per_client: {name!r}: the head is "
                           f"{HEAD_SEP}H1-H2-... with positive hidden widths, got {spec!r}")
    return base, tuple(int(w) for w in widths)


def mlp_head(dim: int, hidden: tuple[int, ...], num_classes: int) -> nn.Sequential:
    """``dim -> hidden[0] -> ... -> num_classes``, ReLU after each hidden layer."""
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [nn.Linear(dim, h), nn.ReLU()]
        dim = h
    return nn.Sequential(*layers, nn.Linear(dim, num_classes))


def build_member(name: str, in_shape: tuple[int, ...], num_classes: int, dim: int,
                 cfg: ModelConfig) -> ProtoNet:
    """Model ``name`` with features of size ``dim`` (a CNN or MLP member's last hidden layer,
    else its native features, projected when their size differs) and its head (linear, or
    the MLP that ``NAME+head:H1-H2`` names)."""
    base, hidden = split_member(name)
    model = _extractor(base, in_shape, num_classes, dim, cfg)
    if hidden is not None:
        model.classifier = mlp_head(model.feature_dim, hidden, num_classes)
    return model


def _extractor(name: str, in_shape: tuple[int, ...], num_classes: int, dim: int,
               cfg: ModelConfig) -> ProtoNet:
    from protofl.models.nets import Mlp
    from protofl.models.registry import build_model

    if name in CNNS:
        return _cnn(in_shape, num_classes, CNNS[name], dim)
    if name in MLPS:
        return Mlp(_input_dim(in_shape), num_classes, (*MLPS[name], dim))
    if name in MOBILENETS:
        model: ProtoNet = MobileNetV2Net(tuple(in_shape), num_classes, cfg.norm,
                                         last=MOBILENETS[name])
    else:
        model = build_model(name, tuple(in_shape), num_classes, cfg)
    if model.feature_dim == dim or not dim:  # dim 0: the model as it is
        return model
    return Projected(model, dim, num_classes, cfg.projection)


def share_extractor(model: ProtoNet, source: dict[str, torch.Tensor]) -> None:
    """Copy the state ``source`` (another member's) into ``model``, the head
    (``classifier.*``) excepted: two members of one extractor with different heads start
    from the same features."""
    own = model.state_dict()
    with torch.no_grad():
        for k, v in source.items():
            if not k.startswith("classifier."):
                own[k].copy_(v)


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
        split_member(n)
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
    first = split_member(distinct[0])[0]
    if not dim:  # the first model's native feature size (built aside: the RNG is kept)
        dim = DEFAULT_DIM
        if first not in CNNS and first not in MLPS:
            with torch.random.fork_rng():
                dim = _extractor(first, in_shape, num_classes, 0, cfg).feature_dim
    models: list[ProtoNet] = []
    extractors: dict[str, dict[str, torch.Tensor]] = {}  # model name -> its first state
    for n in distinct:
        model = build_member(n, in_shape, num_classes, dim, cfg)
        base = split_member(n)[0]
        if base in extractors:
            share_extractor(model, extractors[base])
        extractors.setdefault(base, model.state_dict())
        models.append(wrap(model))
    return ModelGroups(names, distinct, models), dim
