"""A Hugging Face image dataset as a federation, through flwr-datasets (``data.name: hf``).

The dataset is a Hub id (e.g. ``flwrlabs/fed-isic2019``), a folder written by
``datasets``' ``save_to_disk``, or a folder of data files ``datasets.load_dataset`` reads.
Clients come either from a natural split, flwr-datasets' ``NaturalIdPartitioner`` over a
column (``partition_by``, e.g. ``center``: one client per value), or from protofl's own
partitioners (``data.partition``: iid, dirichlet, ...; default Dirichlet(alpha) over 10
clients). The test split, when there is one, is the global test set; otherwise the union of
the clients' local test splits is. Images are channels-first float32 in [0, 1] like every
other loader, resized to ``data.image_size`` when set. Needs the ``hf`` extra.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from protofl.data.federated import FederatedData, from_partition
from protofl.data.images import GREY_MODES, from_pil
from protofl.data.partition import capped, config_partition
from protofl.errors import ProtoflError

HF_CLIENTS = 10
ROW = "__protofl_row"


@dataclass(frozen=True)
class HFOptions:
    """What to load: the ``data.hf_*`` config keys (``dataset`` falls back to data.root)."""

    dataset: str  # Hub id, save_to_disk folder, or folder of data files
    subset: str | None = None  # the Hub dataset's configuration name
    train_split: str = "train"
    test_split: str | None = "test"  # None (or absent): union of the local test splits
    image_column: str | None = None  # None: the first Image feature (else 'image'/'img')
    label_column: str | None = None  # None: the first ClassLabel feature (else 'label')
    partition_by: str | None = None  # natural-id column: one client per value
    image_mode: str | None = None  # "RGB" or "L"; None: from the first image


def options_from_config(cfg: Any) -> HFOptions:
    """Options from a DataConfig: its ``hf_*`` keys, with ``data.root`` as the dataset when
    ``hf_dataset`` is null."""
    dataset = cfg.hf_dataset or cfg.root
    if not dataset:
        raise ProtoflError("data.name hf needs a dataset: set data.root to a Hugging Face "
                           "dataset id (e.g. flwrlabs/fed-isic2019) or a local folder")
    kw = {f: getattr(cfg, f"hf_{f}") for f in HFOptions.__dataclass_fields__ if f != "dataset"}
    return HFOptions(dataset=str(dataset), **kw)


def _datasets():
    try:
        import datasets
        import flwr_datasets  # noqa: F401
    except ImportError:
        raise ProtoflError("data.name hf needs flwr-datasets: pip install 'protofl[hf]'") from None
    return datasets


def load_splits(opts: HFOptions) -> dict:
    """The dataset's splits (name -> datasets.Dataset), loaded or read from disk."""
    datasets = _datasets()
    path = Path(opts.dataset).expanduser()
    try:
        if path.is_dir() and ((path / "dataset_dict.json").exists()
                              or (path / "state.json").exists()):
            d = datasets.load_from_disk(str(path))
        else:
            d = datasets.load_dataset(opts.dataset, opts.subset)
    except Exception as e:  # the library raises many types; all mean "cannot load it"
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise ProtoflError(f"Hugging Face dataset {opts.dataset!r} cannot be loaded: "
                           f"{first}") from None
    if isinstance(d, datasets.Dataset):
        return {opts.train_split: d}
    return dict(d)


def _column(ds, given: str | None, kind: type, names: tuple[str, ...], what: str) -> str:
    features = ds.features
    if given is not None:
        if given not in features:
            raise ProtoflError(f"Hugging Face dataset: no {what} column {given!r}; columns: "
                               f"{', '.join(features)}")
        return given
    for name, f in features.items():
        if isinstance(f, kind):
            return name
    for name in names:
        if name in features:
            return name
    raise ProtoflError(f"Hugging Face dataset: cannot tell the {what} column; name it (columns: "
                       f"{', '.join(features)})")


def _label_coder(splits: list, col: str) -> tuple[list[str], Any]:
    """(class names, function from raw label values to int64 classes)."""
    import datasets

    feature = splits[0].features[col]
    if isinstance(feature, datasets.ClassLabel):
        return list(feature.names), lambda v: np.asarray(v, dtype=np.int64)
    values = [v for s in splits for v in s[col]]
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        if min(values) < 0:
            raise ProtoflError(f"Hugging Face dataset: label column {col!r} has negative "
                               "labels")
        names = [str(c) for c in range(int(max(values)) + 1)]
        return names, lambda v: np.asarray(v, dtype=np.int64)
    if not all(isinstance(v, str) for v in values):
        raise ProtoflError(f"Hugging Face dataset: label column {col!r} holds neither class "
                           "indices nor class names (multi-label is not supported)")
    names = sorted(set(values))
    index = {n: i for i, n in enumerate(names)}
    return names, lambda v: np.asarray([index[x] for x in v], dtype=np.int64)


def _images(ds, col: str, size: int | None, mode: str, batch: int = 256) -> torch.Tensor:
    """Decode a column of images into one (N, C, H, W) float32 tensor."""
    from PIL import Image

    out: torch.Tensor | None = None
    i = 0
    for rows in ds.select_columns([col]).iter(batch_size=batch):
        for im in rows[col]:
            if not isinstance(im, Image.Image):
                im = Image.fromarray(np.asarray(im, dtype=np.uint8))
            a = from_pil(im, size, mode)
            if out is None:
                out = torch.empty((len(ds), *a.shape))
            elif a.shape != tuple(out.shape[1:]):
                raise ProtoflError(f"Hugging Face dataset: image {i} of column {col!r} is "
                                   f"{a.shape[1:]}, the first {tuple(out.shape[2:])}; set "
                                   "data.image_size to resize them")
            out[i] = torch.from_numpy(a)
            i += 1
    if out is None:
        raise ProtoflError("Hugging Face dataset: the split has no images")
    return out


def _mode(ds, col: str, given: str | None) -> str:
    if given is not None:
        if given not in ("RGB", "L"):
            raise ProtoflError(f"image mode {given!r}: allowed RGB or L")
        return given
    first = ds[0][col]
    mode = getattr(first, "mode", None)
    if mode is None:
        shape = np.shape(first)
        return "L" if len(shape) == 2 or shape[-1] == 1 else "RGB"
    return "L" if mode in GREY_MODES else "RGB"


def hf_federation(opts: HFOptions, cfg: Any) -> FederatedData:
    """The federation: ``opts`` say what to load; ``cfg`` (a DataConfig) gives the client
    count, partition, alpha/gamma, seed, local test fraction, max_samples and image_size."""
    splits = load_splits(opts)
    if opts.train_split not in splits:
        raise ProtoflError(f"Hugging Face dataset {opts.dataset!r} has no split "
                           f"{opts.train_split!r}; splits: {', '.join(splits)}")
    train = splits[opts.train_split]
    test = splits.get(opts.test_split) if opts.test_split else None
    img = _column(train, opts.image_column, _datasets().Image, ("image", "img"), "image")
    lab = _column(train, opts.label_column, _datasets().ClassLabel, ("label", "labels"),
                  "label")
    names, code = _label_coder([s for s in (train, test) if s is not None], lab)
    train = train.select(capped(len(train), cfg))
    mode = _mode(train, img, opts.image_mode)
    x = _images(train, img, cfg.image_size, mode)
    y = code(train[lab])
    if opts.partition_by is not None:
        parts = natural_id_parts(train, opts.partition_by, cfg.num_clients)
    else:
        parts = config_partition(y, cfg, "dirichlet", HF_CLIENTS)
    x_test = y_test = None
    if test is not None:
        x_test = _images(test, img, cfg.image_size or tuple(x.shape[2:]), mode)
        y_test = torch.from_numpy(code(test[lab]))
    return from_partition("hf", len(names), x, torch.from_numpy(y), parts, x_test, y_test,
                          cfg.local_test_fraction, cfg.seed, names)


def natural_id_parts(ds, column: str, num_clients: int | None = None) -> list[np.ndarray]:
    """Row indices per client from flwr-datasets' NaturalIdPartitioner over ``column``
    (clients in the partitioner's order: sorted natural ids); the first ``num_clients``."""
    from flwr_datasets.partitioner import NaturalIdPartitioner

    if column not in ds.features:
        raise ProtoflError(f"Hugging Face dataset: no column {column!r} to partition by; "
                           f"columns: {', '.join(ds.features)}")
    p = NaturalIdPartitioner(partition_by=column)
    p.dataset = ds.add_column(ROW, list(range(len(ds))))
    k = p.num_partitions
    if num_clients is not None and num_clients > k:
        raise ProtoflError(f"data.num_clients = {num_clients} but column {column!r} has only "
                           f"{k} distinct values")
    return [np.asarray(p.load_partition(i)[ROW], dtype=np.int64)
            for i in range(num_clients or k)]


def hf_federation_from_config(cfg: Any) -> FederatedData:
    """The registry's builder: ``options_from_config`` then ``hf_federation``."""
    return hf_federation(options_from_config(cfg), cfg)
