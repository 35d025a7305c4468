"""Models by name, installed entry point (``protofl.models``) or import path
(``package.module:factory``): a factory ``(in_shape, num_classes) -> ProtoNet``."""

from __future__ import annotations

import importlib

from protofl import plugins
from protofl.config import ModelConfig
from protofl.errors import ProtoflError
from protofl.models.deeplab import DEFAULTS
from protofl.models.nets import ProtoNet
from protofl.models.pretrained import check_norm

MODELS: dict[str, tuple[str, str]] = {
    "mlp": ("protofl.models.registry:_mlp", "60 -> 128 -> 256 -> C MLP (Synthetic)"),
    "digits_cnn": ("protofl.models.nets:digits_cnn", "2 conv + fc 128 for 8x8 digits"),
    "leaf_cnn": ("protofl.models.nets:leaf_cnn", "LEAF CNN: conv5x5 32/64, fc 256 (28x28)"),
    "celeba_cnn": ("protofl.models.nets:celeba_cnn", "4 x (conv 32, pool, ReLU) (CelebA)"),
    "fedavg_cnn": ("protofl.models.nets:fedavg_cnn",
                   "HtFLlib's FedAvgCNN: conv5x5 32/64 unpadded, fc 512 (CIFAR)"),
    "resnet10": ("protofl.models.resnet:resnet10", "ResNet-10 (HtFLlib's), d = 512"),
    "resnet18": ("protofl.models.resnet:resnet18", "ResNet-18, d = 512 (medical images)"),
    "resnet34": ("protofl.models.resnet:resnet34", "ResNet-34, d = 512"),
    "resnet50": ("protofl.models.resnet:resnet50", "ResNet-50, d = 2048"),
    "resnet101": ("protofl.models.resnet:resnet101", "ResNet-101, d = 2048 (heavy)"),
    "resnet152": ("protofl.models.resnet:resnet152", "ResNet-152, d = 2048 (heavy)"),
    "googlenet": ("protofl.models.googlenet:googlenet", "GoogLeNet (Inception v1), d = 1024"),
    "deeplabv3plus": ("protofl.models.deeplab:deeplabv3plus",
                      "DeepLab-V3+ / MobileNetV2, per-pixel features (segmentation)"),
}


SEG_OPTIONS = ("width", "output_stride", "channels")
RESNETS = ("resnet18", "resnet10", "resnet34", "resnet50", "resnet101", "resnet152")
PRETRAINED = (*RESNETS, "deeplabv3plus")  # the models model.pretrained applies to
NORMALISED = (*PRETRAINED, "googlenet")  # the models model.norm applies to
# DeepLab's config keys (model.*) and the values they take when neither the config nor the
# dataset sets them
DEEPLAB_KEYS = {"width": DEFAULTS["width"], "output_stride": DEFAULTS["output_stride"],
                "seg_channels": DEFAULTS["channels"]}


def check_model_config(cfg: ModelConfig) -> None:
    """One-line errors for a model section that does not fit its model ``cfg.name``: a DeepLab
    key set for another model, ``norm: batch`` or ``pretrained`` for a model without them,
    ``norm: frozen`` without ``pretrained``, or channels that are not a multiple of 8
    (``engine/spec.py`` fills the null keys)."""
    name = cfg.name
    for key, models, given in (("norm", NORMALISED, cfg.norm != "group"),
                               ("pretrained", PRETRAINED, cfg.pretrained is not None)):
        if given and name not in models:
            raise ProtoflError(f"config: model.{key} applies to {', '.join(models)} only, "
                               f"not {name!r}")
    check_norm(cfg)
    given = [k for k in DEEPLAB_KEYS if getattr(cfg, k) is not None]
    if name != "deeplabv3plus" and given:
        raise ProtoflError(f"config: model.{given[0]} applies to deeplabv3plus only, not "
                           f"{name!r}")
    if cfg.seg_channels is not None and cfg.seg_channels % 8:
        raise ProtoflError(f"config: model.seg_channels = {cfg.seg_channels} is out of range; "
                           "allowed: a multiple of 8, >= 8")


def _mlp(in_shape, num_classes):
    from protofl.models.nets import Mlp

    dim = 1
    for s in in_shape:
        dim *= s
    return Mlp(dim, num_classes)


def model_names() -> list[str]:
    """The built-in models, then those installed packages declare."""
    return plugins.names("model", MODELS)


def plugin_model(name: str, in_shape: tuple[int, ...], num_classes: int, options: dict
                 ) -> ProtoNet:
    """A model from a plugin factory ``(in_shape, num_classes) -> ProtoNet``, checked."""
    if options:
        raise ProtoflError(f"model {name!r} has no option {', '.join(sorted(options))}")
    factory = plugins.load("model", name, {k: v[0] for k, v in MODELS.items()})
    try:
        model = factory(tuple(in_shape), num_classes)
    except ProtoflError:
        raise
    except Exception as e:  # noqa: BLE001 - the plugin's own failure, in one line
        raise ProtoflError(f"model {name!r} could not be built for inputs {tuple(in_shape)} "
                           f"and {num_classes} classes: {type(e).__name__}: {e}") from None
    if not isinstance(model, ProtoNet):
        raise ProtoflError(f"model {name!r} built a {type(model).__name__}, not a "
                           "protofl.models.nets.ProtoNet (encode(x) -> z, head(z) -> logits, "
                           "feature_dim)")
    if not isinstance(getattr(model, "feature_dim", None), int):
        raise ProtoflError(f"model {name!r} has no integer feature_dim (the size of z)")
    return model


def build_model(name: str, in_shape: tuple[int, ...], num_classes: int,
                cfg: ModelConfig | None = None, **options) -> ProtoNet:
    """The named model; ``options`` are model-specific keywords (deeplabv3plus: ``width``,
    ``output_stride``, ``channels``)."""
    if name not in MODELS:
        return plugin_model(name, in_shape, num_classes, options)
    allowed = SEG_OPTIONS if name == "deeplabv3plus" else ()
    extra = sorted(set(options) - set(allowed))
    if extra:
        raise ProtoflError(f"model {name!r} has no option {', '.join(extra)}; allowed: "
                           f"{', '.join(allowed) or 'none'}")
    module, func = MODELS[name][0].split(":")
    fn = getattr(importlib.import_module(module), func)
    if name in NORMALISED and name != "deeplabv3plus":
        return fn(in_shape, num_classes, cfg or ModelConfig())
    if name == "deeplabv3plus":
        return fn(in_shape, num_classes, cfg or ModelConfig(), **options)
    return fn(in_shape, num_classes)
