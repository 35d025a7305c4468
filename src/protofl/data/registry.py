"""Every dataset by name, with its paper model and a one-line description."""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass

from protofl.config import DataConfig
from protofl.data import store
from protofl.data.federated import FederatedData
from protofl.errors import ProtoflError


@dataclass(frozen=True)
class DatasetSpec:
    builder: str  # "module:function", the function takes a DataConfig
    model: str  # the paper's model for it
    description: str
    needs_files: bool = True


DATASETS: dict[str, DatasetSpec] = {
    "synthetic": DatasetSpec("protofl.data.registry:_synthetic", "mlp",
                             "Synthetic(alpha, beta), FedProx recipe, 30 clients (no download)",
                             needs_files=False),
    "digits": DatasetSpec("protofl.data.digits:digits_federation", "digits_cnn",
                          "scikit-learn's 8x8 handwritten digits, 10 clients (no download)",
                          needs_files=False),
    "mnist": DatasetSpec("protofl.data.mnist:mnist_federation", "leaf_cnn",
                         "MNIST from the four IDX files; 1,000 clients, two digits each"),
    "femnist": DatasetSpec("protofl.data.leaf:femnist_federation", "leaf_cnn",
                           "FEMNIST (LEAF JSON): letters a-j, 5 classes per client, 200 clients"),
    "celeba": DatasetSpec("protofl.data.leaf:celeba_federation", "celeba_cnn",
                          "CelebA smiling or not (LEAF JSON + images), a client per celebrity"),
    "leaf": DatasetSpec("protofl.data.leaf:leaf_federation", "mlp",
                        "any LEAF JSON folder of vectors (e.g. the FedProx Synthetic files)"),
    "ham10000": DatasetSpec("protofl.data.medical:ham10000_federation", "resnet18",
                            "HAM10000 dermoscopy: metadata CSV + JPEG folders, 7 classes"),
    "matek19": DatasetSpec("protofl.data.medical:matek19_federation", "resnet18",
                           "Matek-19 AML cytomorphology: a TIFF folder per class, 15 classes"),
    "medmnist": DatasetSpec("protofl.data.medical:medmnist_federation", "resnet18",
                            "a MedMNIST .npz file (dermamnist, bloodmnist, ...)"),
    "voc": DatasetSpec("protofl.data.voc:voc_federation", "resnet18",
                       "Pascal VOC 2012 single-class images, 20 classes (classification)"),
    "voc_macro": DatasetSpec("protofl.data.voc:voc_macro_federation", "resnet18",
                             "Pascal VOC 2012 single-class images, the seed's macro classes"),
}


def _synthetic(cfg: DataConfig) -> FederatedData:
    from protofl.data.synthetic import synthetic_federation

    return synthetic_federation(cfg.synthetic_alpha, cfg.synthetic_beta,
                                cfg.num_clients or 30, cfg.seed, cfg.local_test_fraction)


def dataset_spec(name: str) -> DatasetSpec:
    if name not in DATASETS:
        raise ProtoflError(f"unknown dataset {name!r}; allowed: {', '.join(DATASETS)}")
    return DATASETS[name]


def load_dataset(cfg: DataConfig, lean: bool = False) -> FederatedData:
    """Build the federation a data config names (validated, one clear error if not).

    ``lean``: keep the rows in their source dtype (uint8 pixels; callers turn gathered rows
    into model inputs with ``data.inputs``), and a dataset from files whose rows exceed the
    memory budget is written to, and on later runs mapped from, the on-disk cache
    (``data/store.py``). Without it every split is float32 model inputs in memory.
    """
    spec = dataset_spec(cfg.name)
    if spec.needs_files and not cfg.root:
        raise ProtoflError(f"dataset {cfg.name!r} needs its files: set data.root to their folder")
    module, func = spec.builder.split(":")
    builder = getattr(importlib.import_module(module), func)
    if not lean:
        return builder(cfg).decoded()
    if not spec.needs_files:
        return builder(cfg)
    folder = store.cache_home() / f"{cfg.name}-{store.cache_key(asdict(cfg), cfg.root)}"
    cached = store.load_cached(folder)
    if cached is not None:
        return cached
    with store.using(store.Store(store.building_folder(folder), store.data_budget())) as s:
        data = builder(cfg)
    return store.publish(s, data, folder) if s.spilled else data
