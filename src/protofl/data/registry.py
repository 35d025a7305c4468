"""Every dataset by name, with its paper model and a one-line description."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from protofl.config import DataConfig
from protofl.data.federated import FederatedData
from protofl.errors import ProtoflError


@dataclass(frozen=True)
class DatasetSpec:
    builder: str  # "module:function", the function takes a DataConfig
    model: str  # the paper's model for it
    description: str
    needs_files: bool = True
    task: str = "classification"  # or "segmentation": y holds masks (N, H, W), 255 = void


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
    "voc_seg": DatasetSpec("protofl.data.segmentation:voc_seg_federation", "deeplabv3plus",
                           "Pascal VOC 2012 single-object images, 21 classes (segmentation)",
                           task="segmentation"),
    "voc_seg_macro": DatasetSpec("protofl.data.segmentation:voc_seg_macro_federation",
                                 "deeplabv3plus", "Pascal VOC 2012 single-object images, the "
                                 "seed's 5 macro classes (segmentation)", task="segmentation"),
    "shapes": DatasetSpec("protofl.data.shapes:shapes_federation", "deeplabv3plus",
                          "generated textured shapes on clutter, 9 classes, 20 clients "
                          "(segmentation, no download)", needs_files=False,
                          task="segmentation"),
    "shapes_macro": DatasetSpec("protofl.data.shapes:shapes_macro_federation", "deeplabv3plus",
                                "generated shapes, 5 macro classes, 20 clients (segmentation, "
                                "no download)", needs_files=False, task="segmentation"),
}


def _synthetic(cfg: DataConfig) -> FederatedData:
    from protofl.data.synthetic import synthetic_federation

    return synthetic_federation(cfg.synthetic_alpha, cfg.synthetic_beta,
                                cfg.num_clients or 30, cfg.seed, cfg.local_test_fraction)


def dataset_spec(name: str) -> DatasetSpec:
    if name not in DATASETS:
        raise ProtoflError(f"unknown dataset {name!r}; allowed: {', '.join(DATASETS)}")
    return DATASETS[name]


def load_dataset(cfg: DataConfig) -> FederatedData:
    """Build the federation a data config names (validated, one clear error if not)."""
    spec = dataset_spec(cfg.name)
    if spec.needs_files and not cfg.root:
        raise ProtoflError(f"dataset {cfg.name!r} needs its files: set data.root to their folder")
    module, func = spec.builder.split(":")
    return getattr(importlib.import_module(module), func)(cfg)
