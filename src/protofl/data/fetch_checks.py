"""Cheap checks that a fetched folder has the layout its protofl loader reads.

Each takes the folder that will be printed as ``data.root`` and raises ProtoflError naming
what is missing; none reads the whole dataset.
"""

from __future__ import annotations

from pathlib import Path

from protofl.errors import ProtoflError


def mnist(root: Path) -> None:
    from protofl.data.mnist import FILES, find_idx

    for stem in FILES.values():
        find_idx(root, stem)


def fashion_mnist(root: Path) -> None:
    """The four files are the published ones (their uncompressed MD5s; a .gz file of other
    bytes, as Debian's recompressed ones, passes when its content does)."""
    import gzip
    import hashlib

    from protofl.data.mnist import FASHION_PUBLISHED, find_idx

    for stem, (size, md5) in FASHION_PUBLISHED.items():
        path = find_idx(root, stem, "Fashion-MNIST")
        raw = path.read_bytes()
        raw = gzip.decompress(raw) if path.suffix == ".gz" else raw
        got = hashlib.md5(raw).hexdigest()
        if (len(raw), got) != (size, md5):
            raise ProtoflError(f"Fashion-MNIST: {path} is not the published file ({len(raw)} "
                               f"bytes, MD5 {got} uncompressed; expected {size} bytes, MD5 "
                               f"{md5})")


def voc(root: Path) -> None:
    from protofl.data.voc import read_split, voc_root

    base = voc_root(root)
    for split in ("train", "val"):
        read_split(base, split)


def medmnist(root: Path) -> None:
    import numpy as np

    from protofl.data.medical import medmnist_file

    path = medmnist_file(root)
    try:
        with np.load(path, allow_pickle=False) as z:
            keys = set(z.files)
    except (OSError, ValueError) as e:
        raise ProtoflError(f"MedMNIST file {path} is not a readable .npz: {e}") from None
    missing = {"train_images", "train_labels", "test_images", "test_labels"} - keys
    if missing:
        raise ProtoflError(f"MedMNIST file {path} lacks {', '.join(sorted(missing))}")


def ham10000(root: Path) -> None:
    from protofl.data.medical import HAM_METADATA, _find_file

    _find_file(root, HAM_METADATA, ("HAM10000_metadata.tab", "HAM10000_metadata"))
    if not any(root.rglob("*.jpg")):
        raise ProtoflError(f"HAM10000: no .jpg image under {root}")


def leaf(root: Path) -> None:
    from protofl.data.leaf import leaf_layout

    leaf_layout(root)


def celeba(root: Path) -> None:
    from protofl.data.leaf import celeba_image_folder

    leaf(root)
    celeba_image_folder(root)


def matek19(root: Path) -> None:
    from protofl.data.medical import MATEK_CLASSES, matek_class_folder

    base = matek_class_folder(root)
    missing = [c for c in MATEK_CLASSES if not (base / c).is_dir()]
    if len(missing) == len(MATEK_CLASSES):
        raise ProtoflError(f"Matek-19: no class folder ({', '.join(MATEK_CLASSES)}) in {base}")


def _weights(path: Path, keys: tuple[str, ...], what: str) -> None:
    import torch

    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the download's problem
        raise ProtoflError(f"{path.name} is not a readable state_dict ({e})") from None
    if not isinstance(sd, dict):
        raise ProtoflError(f"{path.name} does not hold a state_dict")
    missing = [k for k in keys if k not in sd]
    if missing:
        raise ProtoflError(f"{path.name} is not a {what} state_dict (no {missing[0]!r})")


def mobilenet_v2_weights(path: Path) -> None:
    _weights(path, ("features.0.0.weight", "features.17.conv.3.running_var",
                    "classifier.1.weight"), "torchvision mobilenet_v2")


def resnet18_weights(path: Path) -> None:
    _weights(path, ("conv1.weight", "layer4.1.bn2.running_var", "fc.weight"),
             "torchvision ResNet-18")
