"""Site mode (``data.name: site``): a cross-silo federation whose clients are sites holding
their own files, each trained by its own Flower SuperNode.

The run config fixes what every site must agree on (:func:`agreement`): the number of sites
(``data.num_clients``), the classes (``data.classes``, or ``data.num_classes`` for unnamed
labels 0..C-1) and the model input (``data.input_shape``). A SuperNode loads its own files
in one of the formats protofl reads (:func:`site_data`; ``data.site_format`` or its node
config's ``data-name``) and is refused, with one line, when they hold another class or
another input shape. Its held-out split is the one its format holds out (the ``.npz`` test
arrays, HAM10000's lesion-grouped 20%, an image folder's ``test/`` or a stratified 20%, ...),
else ``data.local_test_fraction`` of its samples. The server (:func:`server_federation`)
holds no training data: only the sites' sizes, which they report when they join, and an
optional test set of its own at ``data.root``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from protofl.config import SITE_FORMATS, DataConfig
from protofl.data.federated import FederatedData, local_test_size
from protofl.errors import ProtoflError

SITE = "site"


@dataclass(frozen=True)
class Agreement:
    """What every site of a federation must have."""

    sites: int
    classes: list[str]
    input_shape: tuple[int, ...]


def agreement(cfg: DataConfig) -> Agreement:
    """The agreement a run config states (one clear error for what is missing or wrong)."""
    if cfg.num_clients is None:
        raise ProtoflError("data.name site needs data.num_clients: the number of sites")
    if cfg.classes:
        if len(set(cfg.classes)) != len(cfg.classes):
            raise ProtoflError(f"data.classes {cfg.classes} names a class twice")
        if cfg.num_classes is not None and cfg.num_classes != len(cfg.classes):
            raise ProtoflError(f"data.num_classes = {cfg.num_classes} but data.classes names "
                               f"{len(cfg.classes)}")
        classes = list(cfg.classes)
    elif cfg.num_classes is not None:
        classes = [str(c) for c in range(cfg.num_classes)]
    else:
        raise ProtoflError("data.name site needs the classes every site agrees on: "
                           "data.classes (names, in label order) or data.num_classes")
    if len(classes) < 2:
        raise ProtoflError("data.name site needs at least 2 classes")
    if not cfg.input_shape or any(d < 1 for d in cfg.input_shape):
        raise ProtoflError("data.name site needs data.input_shape: the model input every "
                           "site's samples have, e.g. [3, 64, 64] (channels, height, width)")
    if cfg.site_format not in SITE_FORMATS:  # (the config's choices say so too)
        raise ProtoflError(f"data.site_format {cfg.site_format!r}: allowed "
                           f"{', '.join(SITE_FORMATS)}")
    return Agreement(cfg.num_clients, classes, tuple(cfg.input_shape))


def load_files(cfg: DataConfig, fmt: str, root: str) -> FederatedData:
    """The files at ``root`` in format ``fmt`` as one client: its training rows are the
    format's pool, ``x_test`` the split the format holds out (possibly empty)."""
    from protofl.data.registry import load_dataset

    if fmt not in SITE_FORMATS:
        raise ProtoflError(f"site data format {fmt!r}: allowed {', '.join(SITE_FORMATS)}")
    if not root:
        raise ProtoflError("site mode: no data folder given (a SuperNode's data-root, the "
                           "server's data.root)")
    mode = cfg.hf_image_mode or ("L" if cfg.input_shape and cfg.input_shape[0] == 1
                                 else "RGB")
    one = dataclasses.replace(cfg, name=fmt, root=root, num_clients=1, partition="iid",
                              local_test_fraction=0.0, hf_dataset=None, hf_partition_by=None,
                              hf_image_mode=mode, classes=[], num_classes=None)
    return load_dataset(one, lean=True)  # rows as stored (uint8 pixels, scale)


def label_map(names: list[str], present: np.ndarray, ag: Agreement, where: str) -> np.ndarray:
    """``old label -> agreed label``. Labels that are bare numbers (``"0".."K-1"``: MedMNIST,
    MNIST, integer Hugging Face labels) keep their index; named classes map by name. A class
    with samples that the agreement lacks is refused."""
    C = len(ag.classes)
    if names == [str(i) for i in range(len(names))]:
        over = [i for i in np.flatnonzero(present) if i >= C]
        if over:
            raise ProtoflError(f"{where}: the data have label {over[0]}, but the federation "
                               f"has {C} classes (labels 0..{C - 1})")
        return np.arange(len(names))
    out = np.full(len(names), -1, dtype=np.int64)
    for i, name in enumerate(names):
        if name in ag.classes:
            out[i] = ag.classes.index(name)
        elif present[i]:
            raise ProtoflError(f"{where}: the data have class {name!r} ({int(present[i])} "
                               f"samples), not one of the federation's classes: "
                               f"{', '.join(ag.classes)}")
    return out


def _agreed(fed: FederatedData, x: torch.Tensor, ys: list[torch.Tensor], ag: Agreement,
            where: str) -> list[torch.Tensor]:
    """``ys`` in the agreed labels, after checking the input shape of ``x``."""
    if tuple(x.shape[1:]) != ag.input_shape:
        raise ProtoflError(f"{where}: samples are {tuple(x.shape[1:])}, the federation's "
                           f"data.input_shape is {list(ag.input_shape)}; set data.image_size "
                           "in the run config or convert the files")
    present = sum(np.bincount(y.numpy(), minlength=fed.num_classes) for y in ys)
    mapping = torch.from_numpy(label_map(fed.class_names, present, ag, where))
    return [mapping[y] for y in ys]


def site_data(cfg: DataConfig, fmt: str, root: str, site: int) -> FederatedData:
    """A SuperNode's federation: ``ag.sites`` clients of which only ``site`` holds rows, the
    files at ``root`` (format ``fmt``), split into training rows and a held-out split,
    labelled by the agreement; a ProtoflError when they do not fit it."""
    ag = agreement(cfg)
    if not 0 <= site < ag.sites:
        raise ProtoflError(f"site {site} is outside 0..{ag.sites - 1} (data.num_clients = "
                           f"{ag.sites})")
    fed = load_files(cfg, fmt, root)
    where = f"site {site} ({fmt} at {root})"
    x, y = fed.client_train(0)
    x_held, y_held = fed.x_test, fed.y_test
    if len(y_held) == 0:  # the format holds nothing out: data.local_test_fraction of it
        order = torch.from_numpy(np.random.default_rng(cfg.seed).permutation(len(y)))
        n = local_test_size(len(y), cfg.local_test_fraction)
        x_held, y_held = x[order[:n]], y[order[:n]]
        x, y = x[order[n:]], y[order[n:]]
    y, y_held = _agreed(fed, x, [y, y_held], ag, where)
    train_off = np.array([0] * (site + 1) + [len(y)] * (ag.sites - site))
    test_off = np.array([0] * (site + 1) + [len(y_held)] * (ag.sites - site))
    return FederatedData(SITE, len(ag.classes), x, y, train_off, x_held, y_held, test_off,
                         x_held, y_held, list(ag.classes), scale=fed.scale)


@dataclass
class SiteFederation(FederatedData):
    """The server's view of a site federation: no client rows, the sites' training sizes as
    they reported them (:meth:`set_sizes`), and the server's own test set (maybe empty)."""

    sizes: np.ndarray | None = None

    @property
    def train_sizes(self) -> np.ndarray:
        if self.sizes is None:
            raise ProtoflError("data.name site: the sites' sample counts are known only once "
                               "their SuperNodes join; run it on Flower (docs/flower.md)")
        return self.sizes

    @property
    def sizes_known(self) -> bool:
        return self.sizes is not None

    def set_sizes(self, sizes: np.ndarray) -> None:
        sizes = np.asarray(sizes, dtype=np.int64)
        if sizes.shape != (self.num_clients,) or (sizes < 0).any():
            raise ProtoflError(f"site sizes {sizes.tolist()} do not fit {self.num_clients} "
                               "sites")
        self.sizes = sizes


def server_federation(cfg: DataConfig) -> SiteFederation:
    """The server's federation (the registry's builder for ``site``): the test set is every
    sample at ``data.root`` (format ``data.site_format``), or none without a root."""
    ag = agreement(cfg)
    empty_y = torch.zeros(0, dtype=torch.long)
    x_test, y_test, scale = torch.zeros((0, *ag.input_shape)), empty_y, None
    if cfg.root:
        fed = load_files(cfg, cfg.site_format, cfg.root)
        x_test, scale = torch.cat([fed.x_train, fed.x_test]), fed.scale
        (y_test,) = _agreed(fed, x_test, [torch.cat([fed.y_train, fed.y_test])], ag,
                            f"the server's test set ({cfg.site_format} at {cfg.root})")
    empty_x = x_test[:0]
    zeros = np.zeros(ag.sites + 1, dtype=np.int64)
    return SiteFederation(SITE, len(ag.classes), empty_x, empty_y, zeros, empty_x, empty_y,
                          zeros, x_test, y_test, list(ag.classes), scale=scale)
