"""Every dataset by name, with its paper model and a one-line description; a plugin dataset
comes from an installed entry point (``protofl.datasets``) or an import path, and is a
:class:`DatasetSpec` or a builder function ``(DataConfig) -> FederatedData``."""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from protofl import plugins
from protofl.config import DataConfig
from protofl.data import cache, store
from protofl.data.federated import FederatedData
from protofl.errors import ProtoflError

log = logging.getLogger("protofl")


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset: how to build it and what a run of it uses unless the config says otherwise."""

    # the builder ``(DataConfig) -> FederatedData``, or its import path "module:function"
    builder: str | Callable[[DataConfig], FederatedData]
    model: str  # the paper's model for it ("": none; the config must name one)
    description: str
    needs_files: bool = True
    partition: str | None = None  # the default partition scheme (None: natural clients)
    task: str = "classification"  # or "segmentation": y holds masks (N, H, W), 255 = void
    augment: str = "none"  # data.augment when the config leaves it null
    model_options: dict = field(default_factory=dict)  # its model's size (e.g. DeepLab width)
    ignores: tuple[str, ...] = ()  # data.* keys it has no use for (set: a warning)


# what a dataset of fixed-size rows read whole has no use for
VECTORS = ("max_samples", "image_size")

# a DeepLab sized for 48 px images on a CPU (benchmarks/shapes_central.py)
SHAPES_MODEL = {"width": 0.5, "seg_channels": 64}

DATASETS: dict[str, DatasetSpec] = {
    "synthetic": DatasetSpec("protofl.data.registry:_synthetic", "mlp",
                             "Synthetic(alpha, beta), FedProx recipe, 30 clients (no download)",
                             needs_files=False, ignores=VECTORS),
    "digits": DatasetSpec("protofl.data.digits:digits_federation", "digits_cnn",
                          "scikit-learn's 8x8 handwritten digits, 10 clients (no download)",
                          needs_files=False, partition="dirichlet", ignores=VECTORS),
    "mnist": DatasetSpec("protofl.data.mnist:mnist_federation", "leaf_cnn",
                         "MNIST from the four IDX files; 1,000 clients, two digits each",
                         partition="classes", ignores=("image_size",)),
    "femnist": DatasetSpec("protofl.data.leaf:femnist_federation", "leaf_cnn",
                           "FEMNIST (LEAF JSON): letters a-j, 5 classes per client, 200 clients",
                           ignores=VECTORS),
    "celeba": DatasetSpec("protofl.data.leaf:celeba_federation", "celeba_cnn",
                          "CelebA smiling or not (LEAF JSON + images), a client per celebrity"),
    "leaf": DatasetSpec("protofl.data.leaf:leaf_federation", "mlp",
                        "any LEAF JSON folder of vectors (e.g. the FedProx Synthetic files)",
                        ignores=VECTORS),
    "ham10000": DatasetSpec("protofl.data.medical:ham10000_federation", "resnet18",
                            "HAM10000 dermoscopy: metadata CSV + JPEG folders, 7 classes",
                            partition="dirichlet"),
    "matek19": DatasetSpec("protofl.data.medical:matek19_federation", "resnet18",
                           "Matek-19 AML cytomorphology: a TIFF folder per class, 15 classes",
                           partition="dirichlet"),
    "medmnist": DatasetSpec("protofl.data.medical:medmnist_federation", "resnet18",
                            "a MedMNIST .npz file (dermamnist, bloodmnist, ...)",
                            partition="dirichlet"),
    "voc": DatasetSpec("protofl.data.voc:voc_federation", "resnet18",
                       "Pascal VOC 2012 single-class images, 20 classes (classification)",
                       partition="dirichlet_powerlaw"),
    "voc_macro": DatasetSpec("protofl.data.voc:voc_macro_federation", "resnet18",
                             "Pascal VOC 2012 single-class images, the seed's macro classes",
                             partition="dirichlet_powerlaw"),
    "imagefolder": DatasetSpec("protofl.data.imagefolder:imagefolder_federation", "resnet18",
                               "a folder of images per class (optionally train/ and test/)",
                               partition="dirichlet"),
    "site": DatasetSpec("protofl.data.site:server_federation", "resnet18",
                        "a cross-silo Flower federation: each SuperNode trains on its own "
                        "files (docs/flower.md)", needs_files=False),
    "hf": DatasetSpec("protofl.data.hf:hf_federation_from_config", "resnet18",
                      "a Hugging Face image dataset via flwr-datasets (data.root = its id or "
                      "a local folder; needs the 'hf' extra)"),
    "voc_seg": DatasetSpec("protofl.data.segmentation:voc_seg_federation", "deeplabv3plus",
                           "Pascal VOC 2012 single-object images, 21 classes (segmentation)",
                           task="segmentation", partition="dirichlet_powerlaw",
                           augment="crop_flip"),
    "voc_seg_macro": DatasetSpec("protofl.data.segmentation:voc_seg_macro_federation",
                                 "deeplabv3plus", "Pascal VOC 2012 single-object images, the "
                                 "seed's 5 macro classes (segmentation)", task="segmentation",
                                 partition="dirichlet_powerlaw", augment="crop_flip"),
    "shapes": DatasetSpec("protofl.data.shapes:shapes_federation", "deeplabv3plus",
                          "generated textured shapes on clutter, 9 classes (a macro group's "
                          "two share colours and textures), 20 clients "
                          "(segmentation, no download)", needs_files=False,
                          task="segmentation", partition="dirichlet_powerlaw",
                          augment="crop_flip", model_options=SHAPES_MODEL),
    "shapes_macro": DatasetSpec("protofl.data.shapes:shapes_macro_federation", "deeplabv3plus",
                                "generated shapes, 5 macro classes, 20 clients (segmentation, "
                                "no download)", needs_files=False, task="segmentation",
                                partition="dirichlet_powerlaw", augment="crop_flip",
                                model_options=SHAPES_MODEL),
    "shapes_v1": DatasetSpec("protofl.data.shapes:shapes_v1_federation", "deeplabv3plus",
                             "the first generator's shapes (a hue and texture per class; "
                             "segmentation, no download)", needs_files=False,
                             task="segmentation", partition="dirichlet_powerlaw",
                             augment="crop_flip", model_options=SHAPES_MODEL),
    "shapes_macro_v1": DatasetSpec("protofl.data.shapes:shapes_macro_v1_federation",
                                   "deeplabv3plus", "the first generator's shapes, 5 macro "
                                   "classes (segmentation, no download)", needs_files=False,
                                   task="segmentation", partition="dirichlet_powerlaw",
                                   augment="crop_flip", model_options=SHAPES_MODEL),
    # the image benchmarks of FedProto / FedTGP (protofl.data.cifar, .tinyimagenet)
    "cifar10": DatasetSpec("protofl.data.cifar:cifar10_federation", "resnet18",
                           "CIFAR-10 python batches, 32x32 RGB, 10 classes, 20 clients",
                           partition="dirichlet", augment="crop_flip"),
    "cifar100": DatasetSpec("protofl.data.cifar:cifar100_federation", "resnet18",
                            "CIFAR-100 python batches (fine labels), 100 classes, 20 clients",
                            partition="dirichlet", augment="crop_flip"),
    "tinyimagenet": DatasetSpec("protofl.data.tinyimagenet:tinyimagenet_federation",
                                "resnet18", "Tiny-ImageNet-200 folders, 64x64 RGB, 200 "
                                "classes, val as test, 20 clients", partition="dirichlet",
                                augment="crop_flip"),
    "cifar_tiny": DatasetSpec("protofl.data.cifar:cifar_tiny_federation", "leaf_cnn",
                              "generated 32x32 RGB textures, 10 classes, 10 clients (a CIFAR "
                              "stand-in, no download)", needs_files=False,
                              partition="dirichlet", augment="crop_flip"),
}


def _synthetic(cfg: DataConfig) -> FederatedData:
    from protofl.data.synthetic import synthetic_federation

    return synthetic_federation(cfg.synthetic_alpha, cfg.synthetic_beta,
                                cfg.num_clients or 30, cfg.seed, cfg.local_test_fraction)


def dataset_task(name: str, task: str | None = None, spec: DatasetSpec | None = None) -> str:
    """The task of dataset ``name`` (``spec``: its entry, when the caller has it); ``task``
    (the config's, if set) must agree with it."""
    spec = spec or dataset_spec(name)
    if task is not None and task != spec.task:
        others = [n for n, s in DATASETS.items() if s.task == task]
        raise ProtoflError(f"config: task = {task} but dataset {name!r} is {spec.task}; "
                           f"{task} datasets: {', '.join(others)}")
    return spec.task


def task_default_dataset(task: str) -> str:
    """The dataset a run of ``task`` uses when none is named (needs no download)."""
    return next(n for n, s in DATASETS.items() if s.task == task and not s.needs_files)


def with_task_dataset(raw: dict) -> dict:
    """A raw config (the YAML's keys) whose ``task`` is set but no ``data.name``: the task's
    default dataset named in it (``protofl run --task segmentation`` and
    ``protofl.run({"task": "segmentation"})`` alike). Other configs are returned as given."""
    task, data = raw.get("task"), raw.get("data")
    if not isinstance(task, str) or task not in {s.task for s in DATASETS.values()} or (
            isinstance(data, dict) and data.get("name")) or (
            data is not None and not isinstance(data, dict)):
        return raw
    return {**raw, "data": {**(data or {}), "name": task_default_dataset(task)}}


def dataset_names() -> list[str]:
    """The built-in datasets, then those installed packages declare."""
    return plugins.names("dataset", DATASETS)


def dataset_spec(name: str) -> DatasetSpec:
    """The entry of dataset ``name``: built in, or a plugin's (a builder function alone has
    no model of its own and needs no files)."""
    if name in DATASETS:
        return DATASETS[name]
    obj = plugins.load("dataset", name, {})
    if isinstance(obj, DatasetSpec):
        return obj
    if callable(obj):
        return DatasetSpec(obj, "", plugins.describe(obj), needs_files=False)
    raise ProtoflError(f"dataset {name!r} is a {type(obj).__name__}, not a DatasetSpec or a "
                       "builder function (DataConfig) -> FederatedData")


# datasets read from another one's files (whose download source is named after it)
SAME_FILES = {"voc_macro": "voc", "voc_seg": "voc", "voc_seg_macro": "voc"}


def fetch_hint(dataset: str) -> str:
    """The end of a missing-files message: which ``protofl data fetch`` gets the dataset."""
    from protofl.data.sources import SOURCES

    files = SAME_FILES.get(dataset, dataset)
    names = [s.name for s in SOURCES.values() if s.dataset == files]
    if not names:
        return ""
    if len(names) == 1:
        cmd = f"'protofl data fetch {names[0]}'"
    else:
        cmd = f"'protofl data fetch NAME' (NAME: {', '.join(names)})"
    return f"; run {cmd} to download it: it prints the data.root to use"


def load_dataset(cfg: DataConfig, lean: bool = False) -> FederatedData:
    """Build the federation a data config names (validated, one clear error if not); a null
    ``partition`` is the loader's default scheme (``engine.spec.resolve_data`` names it).

    ``lean``: keep the rows in their source dtype (uint8 pixels; callers turn gathered rows
    into model inputs with ``data.inputs``), and a dataset from files whose rows exceed the
    memory budget is written to, and on later runs mapped from, the on-disk cache
    (``data/store.py``). Without it every split is float32 model inputs in memory.
    """
    spec = dataset_spec(cfg.name)
    for key in spec.ignores:
        if getattr(cfg, key) is not None:
            log.warning("data.%s = %s is ignored: dataset %r does not use it", key,
                        getattr(cfg, key), cfg.name)
    if spec.needs_files and not cfg.root and cfg.name != "hf":  # hf says what it needs
        raise ProtoflError(f"dataset {cfg.name!r} needs its files: set data.root to their "
                           f"folder{fetch_hint(cfg.name)}")
    if spec.needs_files and cfg.name != "hf" and not Path(cfg.root).expanduser().exists():
        raise ProtoflError(f"data.root {cfg.root} (dataset {cfg.name!r}) does not exist"
                           f"{fetch_hint(cfg.name)}")
    builder = spec.builder
    if isinstance(builder, str):
        module, func = builder.split(":")
        builder = getattr(importlib.import_module(module), func)
    if name_is_plugin := cfg.name not in DATASETS:
        builder = checked(builder, cfg.name)
    if not lean:
        return builder(cfg).decoded()
    if not spec.needs_files:
        return builder(cfg)
    stem = re.sub(r"[^\w.-]", "_", cfg.name) if name_is_plugin else cfg.name
    folder = store.cache_home() / f"{stem}-{store.cache_key(asdict(cfg), cfg.root)}"
    cached = cache.load_cached(folder)
    if cached is not None:
        return cached
    with store.using(store.Store(cache.building_folder(folder), store.data_budget())) as s:
        data = builder(cfg)
    return cache.publish(s, data, folder) if s.spilled else data


def checked(builder: Callable[[DataConfig], FederatedData], name: str
            ) -> Callable[[DataConfig], FederatedData]:
    """A plugin's builder whose failures and wrong results are one line naming it."""
    def build(cfg: DataConfig) -> FederatedData:
        try:
            data = builder(cfg)
        except ProtoflError:
            raise
        except Exception as e:  # noqa: BLE001 - the plugin's own failure, in one line
            raise ProtoflError(f"dataset {name!r} failed to build: {type(e).__name__}: "
                               f"{e}") from None
        if not isinstance(data, FederatedData):
            raise ProtoflError(f"dataset {name!r} built a {type(data).__name__}, not a "
                               "protofl FederatedData")
        return data
    return build
