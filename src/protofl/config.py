"""The typed, validated experiment config: one declaration per option.

Every option is a dataclass field made with :func:`option`: its type (the annotation), its
default, its range or choices and a one-line help. That one declaration validates configs and
algorithm options (a wrong value stops the run with one line naming the key and what is
allowed), writes the table of ``docs/configuration.md`` (:func:`markdown_table`) and the option
list of ``protofl run --help``.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from protofl.errors import ProtoflError

SEED_MAX = 2**32 - 1  # numpy and torch both take seeds in [0, 2^32)
# the datasets whose files a site of a cross-silo federation may hold (data.name: site)
TASKS = ("classification", "segmentation")
AUGMENTATIONS = ("none", "crop_flip")  # the values of data.augment
# the first seed's three Dirichlet splits of its segmentation benchmark, by name
ALPHA_SETTINGS = {"a0.01": 0.01, "a0.1": 0.1, "a1": 1.0}
SITE_FORMATS = ("imagefolder", "medmnist", "ham10000", "matek19", "mnist", "voc", "voc_macro",
                "hf")
FLOAT32_MAX = 3.4028234663852886e38  # optimizer steps take their settings as float32
DEVICES = r"auto|cpu|cuda(:\d+)?|mps"  # what the `device` key accepts
MAX_THREADS = 4096  # torch takes a thread count as a C int; no machine has more cores


@dataclass(frozen=True)
class Rule:
    """What an option allows besides its type: choices or a numeric range."""

    help: str
    choices: tuple[Any, ...] = ()
    ge: float | None = None  # value >= ge
    gt: float | None = None  # value > gt
    le: float | None = None
    lt: float | None = None
    path: bool = False  # a file or folder: '~' is expanded
    fallback: Any = None  # what null means when the algorithm sets no default (engine/spec.py)
    pattern: str | None = None  # a string must match this regular expression (choices: shown)
    auto: bool = False  # the string "auto" is accepted and stands for null


    def allowed(self, hint: Any) -> str:
        """The allowed values in words, e.g. ``an integer >= 1`` or ``sgd or adam``."""
        if self.choices:
            words = (["null"] if _nullable(hint) and not self.auto else []) + [
                str(c) for c in self.choices]
            if typing.get_origin(_base(hint)) is list:
                return "a list of: " + ", ".join(words)
            return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]
        base = _base(hint)
        text = _kind(base)
        bounds = [f"{op} {_num(v)}" for op, v in ((">=", self.ge), (">", self.gt),
                                                   ("<=", self.le), ("<", self.lt))
                  if v is not None]
        if len(bounds) == 2 and base is not int:
            lo, hi = (self.ge, "[") if self.ge is not None else (self.gt, "(")
            up, close = (self.le, "]") if self.le is not None else (self.lt, ")")
            text = f"a number in {hi}{_num(lo)}, {_num(up)}{close}"
        elif bounds:
            text += " " + " and ".join(bounds)
        if not _nullable(hint):
            return text
        if self.auto:
            return "auto or " + text
        return "null, true or false" if base is bool else "null or " + text

    def ok(self, value: Any) -> bool:
        if value is None:
            return True
        if self.pattern is not None:
            return isinstance(value, str) and re.fullmatch(self.pattern, value) is not None
        if self.choices:
            if isinstance(value, list):
                return all(v in self.choices for v in value)
            return value in self.choices
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))


def option(default: Any, help: str, **rule: Any) -> Any:
    """A declared option: ``x: float = option(0.5, "what it is", gt=0)``."""
    meta = {"rule": Rule(help, **rule)}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else f"{v:g}"


def _nullable(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in (
        typing.get_args(hint))


def _kind(hint: Any) -> str:
    """A type in words: ``an integer``, ``a list of strings``, ..."""
    kind = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    origin = typing.get_origin(hint)
    if origin is list:
        item = _kind(typing.get_args(hint)[0])
        return "a list of " + item.split(" ", 1)[1] + "s"
    if origin is dict:
        return "a mapping"
    return kind.get(hint, getattr(hint, "__name__", str(hint)))


def _base(hint: Any) -> Any:
    """``int | None`` -> ``int``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


@dataclass
class DataConfig:
    name: str = option("synthetic", "dataset (see `protofl datasets`)")
    seed: int = option(0, "seed of the data generation and partition (the suites set it to "
                          "the run seed, so each seed has its own partition)", ge=0,
                       le=SEED_MAX)
    root: str | None = option(None, "folder (or file) holding a real dataset's files", path=True)
    num_clients: int | None = option(None, "number of clients (null: the dataset's own)", ge=1)
    partition: str | None = option(
        None, "iid, classes (k per client, power-law sizes), dirichlet (label skew), "
              "dirichlet_powerlaw (Dirichlet mix, power-law sizes), or a plugin's scheme; "
              "null: the dataset's own")
    alpha: float = option(0.5, "Dirichlet concentration", gt=0)
    gamma: float = option(3.0, "power-law exponent of client sizes", gt=1)
    classes_per_client: int = option(2, "k of the `classes` partition", ge=1)
    synthetic_alpha: float = option(1.0, "α of Synthetic(α, β): how much local models differ",
                                    ge=0)
    synthetic_beta: float = option(1.0, "β of Synthetic(α, β): how much local data differ",
                                   ge=0)
    local_test_fraction: float = option(0.1, "share of each client's samples kept as its local "
                                             "test split", ge=0, lt=1)
    validation_fraction: float = option(0.0, "share of each client's training samples held out "
                                             "as its validation split, never trained on "
                                             "(metrics.early_stop reads it)", ge=0, lt=1)
    image_size: int | None = option(None, "resize images to this side (null: the dataset's "
                                          "own)", ge=1)
    max_samples: int | None = option(None, "cap the sample pool (quick runs on large sets)",
                                     ge=1)
    pooled: bool = option(False, "pool every client's training data into one client taking a "
                                 "federated round's expected SGD steps each round (the "
                                 "centralized baseline; `central` sets it)")
    augment: str | None = option(
        None, "augmentation of every client's training batches, seeded per (round, client): "
              "crop_flip (random resized crop + horizontal flip, masks with their images) or "
              "none; null: the dataset's (segmentation sets: crop_flip)",
        choices=AUGMENTATIONS)
    # data.name hf (Hugging Face datasets through flwr-datasets; docs/datasets.md)
    hf_dataset: str | None = option(None, "hf: a Hub dataset id, a save_to_disk folder or a "
                                          "folder of data files (null: data.root)")
    hf_subset: str | None = option(None, "hf: the Hub dataset's configuration (subset) name")
    hf_train_split: str = option("train", "hf: the split the clients train on")
    hf_test_split: str | None = option("test", "hf: the split used as the global test set "
                                               "(null or absent: the clients' local test "
                                               "splits together)")
    hf_image_column: str | None = option(None, "hf: the image column (null: the first Image "
                                               "feature, else 'image' or 'img')")
    hf_label_column: str | None = option(None, "hf: the label column (null: the first "
                                               "ClassLabel feature, else 'label' or 'labels')")
    hf_partition_by: str | None = option(None, "hf: a column whose values are the clients "
                                               "(flwr-datasets' NaturalIdPartitioner, e.g. "
                                               "center); null: data.partition")
    hf_image_mode: str | None = option(None, "hf: images as RGB or L (grey); null: from the "
                                             "first image", choices=("RGB", "L"))
    # data.name site (a cross-silo Flower federation; docs/flower.md)
    classes: list[str] = option([], "site: the class names all sites agree on, in label order "
                                    "(or data.num_classes)")
    num_classes: int | None = option(None, "site: the number of classes when they have no "
                                           "names (labels 0..C-1)", ge=1)
    input_shape: list[int] = option([], "site: the model input every site's samples must have, "
                                        "e.g. [3, 64, 64] (C, H, W); an image folder reads C")
    site_format: str = option("imagefolder", "site: the layout of the sites' files and of the "
                                             "server's optional test set at data.root; a "
                                             "SuperNode's data-name overrides it",
                              choices=SITE_FORMATS)


@dataclass
class ModelConfig:
    name: str = option("auto", "model (auto: the dataset's paper model; see docs)")
    norm: str = option("group", "ResNet, GoogLeNet and DeepLab normalisation (BatchNorm trains "
                                "sequentially; frozen: the pretrained BatchNorm statistics "
                                "frozen)", choices=("group", "batch", "frozen"))
    pretrained: str | None = option(None, "a local ImageNet state_dict for a ResNet (or "
                                          "torchvision's mobilenet_v2 for DeepLab's encoder)",
                                    path=True)
    width: float | None = option(None, "deeplabv3plus: MobileNetV2 width multiplier (null: "
                                       "the dataset's; shapes 0.5, else 1)", gt=0, le=4)
    output_stride: int | None = option(None, "deeplabv3plus: encoder output stride (null: 16)",
                                       choices=(8, 16))
    seg_channels: int | None = option(None, "deeplabv3plus: ASPP/decoder channels, the pixel "
                                            "feature size d, a multiple of 8 (null: the "
                                            "dataset's; shapes 64, else 256)", ge=8)
    # model-heterogeneous federations (models/families.py, docs/configuration.md)
    per_client: list[str] = option([], "client k trains the model at position k mod n "
                                       "(the methods that train a model per client: "
                                       "docs/algorithms.md, 'Heterogeneous models')")
    family: str | None = option(None, "a preset model group (models/families.py FAMILIES)")
    feature_dim: int | None = option(None, "heterogeneous: the shared feature size d (null: "
                                           "the family's, else the first model's)", ge=1)
    projection: str = option("pool", "heterogeneous: how a model's features reach d",
                             choices=("pool", "linear"))


@dataclass
class ClientConfig:
    per_round: int = option(10, "K', active clients per round", ge=1)
    local_epochs: int | None = option(None, "E, local epochs per round", ge=1, fallback=1)
    local_steps: int | None = option(None, "if set, exactly this many local batches per round "
                                           "instead of epochs", ge=1)
    batch_size: int | None = option(None, "local batch size", ge=1, fallback=10)
    optimizer: str | None = option(None, "local optimizer (its state lives for one round)",
                                   choices=("sgd", "adam"), fallback="sgd")
    lr: float | None = option(None, "local learning rate", gt=0, le=FLOAT32_MAX, fallback=0.01)
    momentum: float | None = option(None, "SGD momentum", ge=0, lt=1, fallback=0.0)
    weight_decay: float | None = option(None, "L2 weight decay of the local optimizer", ge=0,
                                        le=FLOAT32_MAX, fallback=0.0)
    lr_decay: float = option(1.0, "per-round factor of the local learning rate: round t "
                             "trains at lr * lr_decay^(t-1) (HtFLlib's learning_rate_decay_gamma, "
                             "0.99 where its scripts switch it on)", gt=0, le=1)
    dropout: float = option(0.0, "share of each round's sampled clients that drop out before "
                                 "training and send nothing (HtFLlib's client_drop_rate)",
                            ge=0, lt=1)
    stragglers: float = option(0.0, "δ, the share of active clients doing partial work",
                               ge=0, lt=1)
    tolerate_partial: bool | None = option(
        None, "aggregate stragglers' partial work (true) or drop them (false)", fallback=False)
    sampling: str | None = option(None, "client sampling: weighted (∝ n_k) or uniform",
                                  choices=("weighted", "uniform"), fallback="uniform")


@dataclass
class MetricsConfig:
    dissimilarity_clients: int = option(30, "gradient dissimilarity estimated on this many "
                                            "seeded probe clients (0: off)", ge=0)
    dissimilarity_rows: int = option(100, "rows per probe client in that estimate: its first N "
                                          "training rows (0: off)", ge=0)
    dissimilarity_exact: bool = option(False, "gradient dissimilarity over every client and all "
                                              "its rows (the seed's figure; costly) instead of "
                                              "the seeded estimate")
    amm: bool = option(True, "log the aggregate mean margin (AMM)")
    train_loss_samples: int = option(2000, "training loss of the aggregate model on a seeded "
                                           "sample of up to this many rows (0: off)", ge=0)
    eval_batch: int = option(256, "evaluation batch size", ge=1)
    early_stop: int = option(0, "stop after this many evaluated rounds without a new best "
                                "validation accuracy (0: off; needs data.validation_fraction)",
                             ge=0)
    every: int = option(5, "costly figures (training loss, gradient dissimilarity, and with an "
                           "aggregate model the clients' local accuracy) on evaluated rounds "
                           "that are a multiple of N, and the last (0: never)", ge=0)
    save_weights: bool | None = option(
        None, "keep the aggregate weights of every round in weights/round_NNNN.safetensors "
              "(an FFD reference); null: true for central, else false", fallback=False)
    ffd_reference: str | None = option(
        None, "run folder of a reference run (e.g. central) that saved its weights: log "
              "`mmd`, the client-averaged MMD² to its features, on evaluated rounds",
        path=True)
    ffd_probe: int = option(128, "global-test samples in the FFD probe (the same for every "
                                 "run seed: drawn with data.seed)", ge=2)
    ffd_estimator: str = option("biased", "MMD² estimator of FFD",
                                choices=("biased", "unbiased"))
    ffd_rows: int = option(2048, "at most this many feature rows per model and round "
                                 "(per-pixel features are subsampled, the same rows for "
                                 "every model)", ge=2)


@dataclass
class PrivacyConfig:
    noise_multiplier: float = option(0.0, "client-level DP: sigma, the Gaussian noise std over "
                                          "each part's L2 bound (0: off)", ge=0, le=1e4)
    clip: float = option(1.0, "C, bound on the L2 norm of a client's weights update", gt=0)
    proto_clip: float = option(10.0, "C_p, bound on the L2 norm of each prototype row", gt=0)
    noise: str = option("server", "who adds the noise: the server to the sum, or each client "
                                  "its share (needs an algorithm whose server needs only sums)",
                        choices=("server", "client"))
    delta: float = option(1e-5, "delta of the (epsilon, delta) guarantee", gt=0, lt=1)
    sampling: str = option("fixed", "sampling the accountant assumes: fixed-size cohorts "
                                    "(what the engine does) or Poisson (an approximation)",
                           choices=("fixed", "poisson"))
    accountant: str = option("rdp", "privacy accountant (pld needs poisson)",
                             choices=("rdp", "pld"))
    budget: float | None = option(None, "epsilon budget (null: none)", gt=0)
    on_budget: str = option("stop", "at the budget: stop before the round that would exceed "
                                    "it, or warn once and go on", choices=("stop", "warn"))
    secagg: bool = option(False, "sum the clients' uploads securely (SecAgg+ on Flower; "
                                 "simulated sums in process); needs an algorithm whose server "
                                 "needs only sums")
    secagg_shares: float = option(1.0, "SecAgg+: share of the round's clients each client's "
                                       "secrets are split among", gt=0, le=1)
    secagg_threshold: float = option(0.5, "SecAgg+: share of those shares needed to unmask",
                                     gt=0, le=1)
    secagg_range: float = option(8.0, "SecAgg+: every contribution entry must lie in "
                                      "[-range, range]; it is quantised to 2^22 levels", gt=0)
    secagg_max_weight: float = option(1000.0, "SecAgg+ without DP: sample counts are divided "
                                              "by this to fit the range", gt=0)
    adaptive_clip: bool = option(False, "adaptive clipping (Andrew et al., 2021): the clip "
                                        "norm starts at `clip` and follows a target quantile "
                                        "of the update norms, estimated privately (DP, noise: "
                                        "server)")
    target_quantile: float = option(0.5, "adaptive clipping: the share of updates left "
                                         "unclipped it aims at", gt=0, lt=1)
    clip_lr: float = option(0.2, "adaptive clipping: eta, the clip norm's geometric step",
                            gt=0)
    clip_count_std: float | None = option(None, "adaptive clipping: sigma_b, the noise std on "
                                                "the count of unclipped updates (null: "
                                                "clients.per_round / 20; above "
                                                "noise_multiplier / 2)", gt=0)
    reproducible_noise: bool = option(False, "TESTS ONLY: draw the DP noise from the run seed "
                                             "(anyone with config.json can remove it; every "
                                             "metrics line says private: false) instead of "
                                             "the OS's CSPRNG")


@dataclass
class Config:
    algorithm: str = option("fedmargin", "algorithm (see `protofl algorithms`)")
    task: str | None = option(None, "classification or segmentation; null: the dataset's "
                                    "(a dataset of the other task is an error)",
                              choices=TASKS)
    seed: int = option(0, "model initialisation, client sampling, stragglers, batch order",
                       ge=0, le=SEED_MAX)
    rounds: int = option(50, "communication rounds", ge=1)
    eval_every: int = option(1, "evaluate (and log a line of metrics.jsonl) every N rounds; "
                                "the last round always", ge=1)
    checkpoint_every: int = option(10, "save the checkpoint every N rounds and always after "
                                       "the last (0: after the last only)", ge=0)
    trainer: str = option("auto", "who trains a round's clients: auto (each round the trainer "
                                  "the cost model finds cheapest for that round's work), or "
                                  "one trainer by name (`protofl trainers` lists them)")
    calibrate: bool = option(True, "trainer auto: measure the trainers' step costs on this "
                                   "machine once per model (a few seconds, kept in protofl's "
                                   "cache) instead of using fixed constants")
    trainer_plan: str | None = option(None, "trainer auto: a run folder whose recorded "
                                            "trainer of every round (plan.jsonl) this run "
                                            "replays, so its numbers repeat bit for bit",
                                      path=True)
    workers: int | None = option(None, "worker processes of the parallel trainer (auto: every "
                                       "usable core; more are capped to them); also the "
                                       "least torch threads of the evaluation between "
                                       "rounds", ge=1, auto=True)
    device: str = option("auto", "where the model trains and is evaluated (auto: CUDA when "
                                 "present, else the CPU)",
                         choices=("auto", "cpu", "cuda", "cuda:N", "mps"), pattern=DEVICES)
    precision: str = option("fp32", "forward passes in float32, or mixed precision (autocast) "
                                    "in bfloat16 or float16 (with a loss scaler)",
                            choices=("fp32", "bf16", "fp16"))
    threads: int | None = option(None, "torch threads of the run (null: 1 for models under a "
                                       "million parameters, else half the usable cores); "
                                       "results are bit-identical only at a fixed count",
                                 ge=1, le=MAX_THREADS)
    deterministic: bool = option(False, "CUDA: deterministic kernels only "
                                        "(torch.use_deterministic_algorithms), no TF32, so a "
                                        "run repeats bit for bit on the same GPU and software; "
                                        "slower; the CPU's numbers are the same either way")
    callbacks: list[str] = option([], "extra round callbacks, as `module:Class` import paths")
    tracking: list[str] = option([], "experiment trackers fed each evaluated round (needs a "
                                     "run folder)", choices=("tensorboard", "mlflow"))
    tracking_dir: str | None = option(
        None, "MLflow's store: a folder (SQLite + artefacts, no server) or a tracking URI "
              "(null: mlruns in the working folder); TensorBoard writes <run>/tensorboard",
        path=True)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    clients: ClientConfig = field(default_factory=ClientConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    algo: dict[str, Any] = field(default_factory=dict)  # the algorithm's own options
    plugins: dict[str, Any] = option({}, "written by protofl: where each plugin the run names "
                                         "comes from (config key -> import path, package, "
                                         "version), checked on resume and by Flower nodes")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---- building and checking ----

def build(cls: type, raw: Any, where: str = "") -> Any:
    """An instance of the option dataclass ``cls`` from a raw mapping: unknown keys, wrong
    types and values outside an option's declared rule raise one-line ProtoflErrors."""
    if not isinstance(raw, dict):
        raise ProtoflError(f"config: {where or 'the config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in fields:
            allowed = ", ".join(sorted(fields))
            raise ProtoflError(f"config: unknown key {path!r}; allowed: {allowed}")
        rule = fields[key].metadata.get("rule")
        if rule is not None and rule.auto and value == "auto":
            value = None
        value = _coerce(hints[key], value, path)
        if rule is not None:
            if rule.path and isinstance(value, str):
                value = os.path.expanduser(value)
            if not rule.ok(value):
                raise ProtoflError(f"config: {path} = {value!r} is out of range; allowed: "
                                   f"{rule.allowed(hints[key])}")
        kwargs[key] = value
    return cls(**kwargs)


def _number(value: str) -> float | None:
    """A numeric string as a float (YAML 1.1 reads ``1e-3`` as a string), else None."""
    try:
        return float(value.strip())
    except ValueError:
        return None


def _coerce(hint: Any, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return build(hint, value, path)
    if value is None and _nullable(hint):
        return None
    hint = _base(hint)
    origin = typing.get_origin(hint)
    if origin is dict and isinstance(value, dict):
        return dict(value)
    if origin is list and isinstance(value, list):
        (item,) = typing.get_args(hint)
        return [_coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, str) and hint in (int, float):
        value = _number(value) if _number(value) is not None else value
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and not isinstance(value, bool):
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ProtoflError(f"config: {path} = {value!r} should be a finite number")
        return float(value)
    if hint is str and isinstance(value, str):
        return value
    raise ProtoflError(f"config: {path} = {value!r} should be {_kind(hint)}")


def config_from_dict(raw: dict[str, Any]) -> Config:
    return build(Config, raw)


def declared(cls: type) -> list[tuple[str, Any, Any, Rule | None]]:
    """``(name, type hint, default, rule)`` of every field of an option dataclass."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        out.append((f.name, hints[f.name], default, f.metadata.get("rule")))
    return out


def option_rows(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """``(key, default, allowed, help)`` of every declared option, sections flattened."""
    rows = []
    for name, hint, default, rule in declared(cls):
        if dataclasses.is_dataclass(hint):
            rows += option_rows(hint, f"{prefix}{name}.")
        elif rule is not None:
            shown = json.dumps(default, ensure_ascii=False)
            if rule.auto and default is None:
                shown = '"auto"'
            if rule.fallback is not None:
                shown = f"algorithm's, else {json.dumps(rule.fallback)}"
            rows.append((f"{prefix}{name}", shown, rule.allowed(hint), rule.help))
    return rows


def markdown_table(cls: type = Config, prefix: str = "") -> str:
    """The options of ``cls`` as a Markdown table (the one in docs/configuration.md)."""
    lines = ["| key | default | allowed | meaning |", "|---|---|---|---|"]
    for key, default, allowed, text in option_rows(cls, prefix):
        shown = default if default.startswith("algorithm's") else f"`{default}`"
        lines.append(f"| `{key}` | {shown} | {allowed} | {text} |")
    return "\n".join(lines)


# ---- raw mappings: files and --set ----

class _DuplicateKey(Exception):
    """A key given twice in one mapping of a config file (YAML and JSON keep the last)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in one mapping."""

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, collections.abc.Hashable):
                continue  # refused by SafeLoader itself, as a YAMLError
            if key in seen:
                raise _DuplicateKey(f"key {key!r} is given twice (line "
                                    f"{key_node.start_mark.line + 1}); keep one")
            seen.add(key)
        return super().construct_mapping(node, deep)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(f"key {k!r} is given twice; keep one")
        out[k] = v
    return out


def load_raw(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON config file into a mapping (one clear error when unreadable)."""
    p = Path(os.path.expanduser(str(path)))
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ProtoflError(f"config file {p}: {getattr(e, 'strerror', None) or e}") from None
    try:
        raw = (json.loads(text, object_pairs_hook=_unique_pairs) if p.suffix == ".json"
               else yaml.load(text, Loader=_UniqueKeyLoader))  # noqa: S506 - a SafeLoader
    except _DuplicateKey as e:
        raise ProtoflError(f"config file {p}: {e}") from None
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ProtoflError(f"config file {p} is not valid YAML/JSON: {first}") from None
    if raw is None:
        raise ProtoflError(f"config file {p} is empty; leave it out to run the defaults")
    if not isinstance(raw, dict):
        raise ProtoflError(f"config file {p} must hold a mapping at the top level")
    return raw


def apply_set(raw: dict[str, Any], assignment: str) -> None:
    """Apply one ``--set section.key=value`` (value parsed as YAML) to a raw config mapping."""
    if "=" not in assignment:
        raise ProtoflError(f"--set {assignment!r}: expected KEY=VALUE")
    key, text = assignment.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ProtoflError(f"--set {assignment!r}: empty key")
    if not text.strip():
        raise ProtoflError(f"--set {assignment!r}: no value; write {key.strip()}=null for the "
                           "default")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ProtoflError(f"--set {key}: {part} is not a section")
    node[parts[-1]] = value


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge two raw config mappings (``over`` wins)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out

