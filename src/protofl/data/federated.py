"""The federated dataset container: each split is one contiguous tensor, clients are ranges.

Rows are stored in their source dtype (uint8 pixels for 8-bit images) and turned into model
inputs per batch by ``FederatedData.inputs``. Builders take their samples from a *source*: a
tensor, a numpy array, or a ``Rows`` object that decodes rows on demand (image files), and
fill the split arrays in client order directly, so the data is never held twice; the arrays
come from ``store.allocate`` (memory, or a memory-mapped cache past the budget).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import torch

from protofl import sizes
from protofl.data import store
from protofl.errors import ProtoflError

GATHER_CHUNK = 4096  # rows copied per step when gathering a split from a source


class Rows(Protocol):
    """Samples decoded on demand: ``fill(index, out)`` writes rows ``index`` into ``out``."""

    dtype: torch.dtype

    def __len__(self) -> int: ...

    @property
    def row_shape(self) -> tuple[int, ...]: ...

    def fill(self, index: np.ndarray, out: torch.Tensor) -> None: ...


Source = torch.Tensor | np.ndarray | Rows


@functools.lru_cache(maxsize=32)
def _channel_stats(mean: tuple[float, ...], std: tuple[float, ...], trailing: int,
                   dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std shaped (C, 1, ..., 1), made once per dtype and device (a
    step or an evaluation batch would otherwise copy them to the device every time)."""
    shape = (len(mean),) + (1,) * trailing
    return (torch.tensor(mean, dtype=dtype, device=device).reshape(shape),
            torch.tensor(std, dtype=dtype, device=device).reshape(shape))


@dataclass
class FederatedData:
    """All samples of a federation, stored once.

    Client ``k``'s training samples are ``x_train[train_offsets[k]:train_offsets[k+1]]`` (the
    same for its local test split), so a round touches only the rows of its active clients and
    1,000 clients cost no more memory than their samples. ``x_test``/``y_test`` is the global
    test set used to evaluate the aggregate model.

    Segmentation: ``y`` splits are masks ``(N, H, W)`` (uint8, 255 = void) and the optional
    ``labels_*`` give each image's object class. ``class_counts[k, c]`` then counts client k's
    training images whose object class is c (the background column stays 0); without labels,
    the images whose mask contains c.

    With ``scale`` set, rows hold integers (e.g. uint8 pixels) and ``inputs`` divides them by
    ``scale`` (255 for 8-bit images); without, rows are model inputs already. ``mean`` and
    ``std`` (one value per channel, with ``scale``) then standardise each channel of the
    scaled rows, ``(x / scale - mean) / std`` (what an ImageNet-pretrained encoder expects).
    """

    name: str
    num_classes: int
    x_train: torch.Tensor
    y_train: torch.Tensor
    train_offsets: np.ndarray
    x_local_test: torch.Tensor
    y_local_test: torch.Tensor
    test_offsets: np.ndarray
    x_test: torch.Tensor
    y_test: torch.Tensor
    class_names: list[str] = field(default_factory=list)
    labels_train: torch.Tensor | None = None  # per-image object class when y holds masks
    labels_local_test: torch.Tensor | None = None
    labels_test: torch.Tensor | None = None
    scale: float | None = None
    mean: tuple[float, ...] | None = None  # per-channel standardisation of scaled rows
    std: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        self.train_offsets = np.asarray(self.train_offsets, dtype=np.int64)
        self.test_offsets = np.asarray(self.test_offsets, dtype=np.int64)
        if len(self.train_offsets) != len(self.test_offsets):
            raise ProtoflError(f"{self.name}: train and local-test splits disagree on client count")
        if self.train_offsets[-1] != len(self.x_train) or self.test_offsets[-1] != len(
            self.x_local_test
        ):
            raise ProtoflError(f"{self.name}: client offsets do not cover the samples")
        if not self.class_names:
            self.class_names = [str(c) for c in range(self.num_classes)]
        if self.scale is not None and self.x_train.is_floating_point():
            raise ProtoflError(f"{self.name}: a scale is given but the rows are already floats")
        if (self.mean is None) != (self.std is None) or (self.mean is not None and (
                self.scale is None or len(self.mean) != len(self.std) or min(self.std) <= 0)):
            raise ProtoflError(f"{self.name}: mean and std need a scale, one value per channel "
                               "each and std > 0")
        if self.labels_train is not None and len(self.labels_train) != len(self.y_train):
            raise ProtoflError(f"{self.name}: labels_train does not match the training samples")
        self.check_labels()
        sizes.check([sizes.Need("data.num_clients", self.num_clients,
                                self.num_clients * self.num_classes * 8,
                                f"the class counts of {self.num_clients} clients x "
                                f"{self.num_classes} classes")])
        counts = np.zeros((self.num_clients, self.num_classes), dtype=np.int64)
        y = (self.y_train if self.labels_train is None else self.labels_train).numpy()
        if y.ndim > 1:
            y = _present(y, self.num_classes)
        for k in range(self.num_clients):
            part = y[self.train_offsets[k] : self.train_offsets[k + 1]]
            counts[k] = (part.sum(0) if part.ndim > 1 else
                         np.bincount(part, minlength=self.num_classes))
        self.class_counts = counts  # (K, C) training samples per client and class

    def check_labels(self) -> None:
        """Every class label (of a classification split, or an image's object class) lies in
        ``0 .. num_classes - 1``, the classes the data declares: one line naming the split
        otherwise, before a label indexes or sizes an array (``sizes.check_labels``)."""
        splits = [("training", self.labels_train), ("local test", self.labels_local_test),
                  ("test", self.labels_test)]
        if self.y_train.dim() == 1:
            splits += [("training", self.y_train), ("local test", self.y_local_test),
                       ("test", self.y_test)]
        for split, y in splits:
            if y is not None:
                sizes.check_labels(self.name, split, y, self.num_classes)

    def inputs(self, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Model inputs from stored rows (gathered from any split): integer rows as ``dtype``
        divided by ``scale`` and, with ``mean``/``std``, standardised per channel (a row's
        first dimension), bit-identical to converting the source up front; floating rows
        are returned as they are."""
        if self.scale is None or x.is_floating_point():
            return x
        out = x.to(dtype).div_(self.scale)
        if self.mean is None:
            return out
        mean, std = _channel_stats(self.mean, self.std, len(self.input_shape) - 1, dtype,
                                   x.device)  # (C, 1, 1): broadcast over any leading dims
        return out.sub_(mean).div_(std)

    def decoded(self) -> FederatedData:
        """The same federation with every split converted to float32 model inputs (how all
        data was held before rows were stored in their source dtype)."""
        if self.scale is None:
            return self
        local = self.inputs(self.x_local_test)
        test = local if self.x_test is self.x_local_test else self.inputs(self.x_test)
        return replace(self, x_train=self.inputs(self.x_train), x_local_test=local,
                       x_test=test, scale=None, mean=None, std=None)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored rows of all splits (the global test set once if shared)."""
        xs = [self.x_train, self.x_local_test]
        if self.x_test is not self.x_local_test:
            xs.append(self.x_test)
        return sum(x.numel() * x.element_size() for x in xs)

    @property
    def task(self) -> str:
        """``"segmentation"`` when targets are masks ``(N, H, W)``, else
        ``"classification"``."""
        return "segmentation" if self.y_train.dim() == 3 else "classification"

    @property
    def num_clients(self) -> int:
        return len(self.train_offsets) - 1

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def train_sizes(self) -> np.ndarray:
        return np.diff(self.train_offsets)

    @property
    def sizes_known(self) -> bool:
        """Whether ``train_sizes`` is known (a Flower site federation's is once its nodes
        report)."""
        return True

    def client_train(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.train_offsets[k], self.train_offsets[k + 1]
        return self.x_train[a:b], self.y_train[a:b]

    def client_test(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.test_offsets[k], self.test_offsets[k + 1]
        return self.x_local_test[a:b], self.y_local_test[a:b]

    def pooled(self) -> FederatedData:
        """The same samples as one client holding every client's training and local test
        rows (the centralized baseline)."""
        return replace(self, train_offsets=np.array([0, len(self.y_train)]),
                       test_offsets=np.array([0, len(self.y_local_test)]))

    def hold_out(self, fraction: float, rng: np.random.Generator
                 ) -> tuple[FederatedData, FederatedData]:
        """``floor(fraction * n_k)`` of each client's training rows, drawn by ``rng``, held out
        as its validation split: the federation without them (rows in their order), and one
        whose local test splits are the validation rows (the rest as it was)."""
        keep, val, tr, va = [], [], [0], [0]
        for k in range(self.num_clients):
            a, b = int(self.train_offsets[k]), int(self.train_offsets[k + 1])
            held = np.zeros(b - a, dtype=bool)
            held[rng.choice(b - a, size=int(fraction * (b - a)), replace=False)] = True
            keep.append(a + np.flatnonzero(~held))
            val.append(a + np.flatnonzero(held))
            tr.append(tr[-1] + len(keep[-1]))
            va.append(va[-1] + len(val[-1]))
        keep_t, val_t = (torch.from_numpy(np.concatenate(i)) for i in (keep, val))
        labels = self.labels_train
        train = replace(self, x_train=self.x_train[keep_t], y_train=self.y_train[keep_t],
                        train_offsets=np.array(tr),
                        labels_train=None if labels is None else labels[keep_t])
        validation = replace(train, x_local_test=self.x_train[val_t],
                             y_local_test=self.y_train[val_t], test_offsets=np.array(va),
                             labels_local_test=None if labels is None else labels[val_t])
        return train, validation

    def summary(self) -> dict:
        """Partition statistics: sizes and classes per client (the seed's Fig. S1)."""
        sizes = self.train_sizes
        classes = (self.class_counts > 0).sum(1)
        return {
            "dataset": self.name,
            "clients": self.num_clients,
            "classes": self.num_classes,
            "train_samples": int(sizes.sum()),
            "local_test_samples": int(len(self.x_local_test)),
            "global_test_samples": int(len(self.x_test)),
            "samples_per_client": _describe(sizes),
            "classes_per_client": _describe(classes),
        }


def _present(masks: np.ndarray, num_classes: int) -> np.ndarray:
    """``(N, C)`` 0/1: whether each mask holds class c (void and other values ignored)."""
    flat = masks.reshape(len(masks), -1).astype(np.int64)
    out = np.zeros((len(masks), num_classes), dtype=np.int64)
    for c in range(num_classes):
        out[:, c] = (flat == c).any(1)
    return out


def _target(y: torch.Tensor) -> torch.Tensor:
    """Class labels as int64; masks keep their dtype (uint8 holds 0..C-1 and 255)."""
    return y.long() if y.dim() == 1 else y


def _describe(v: np.ndarray) -> dict:
    return {"min": int(v.min()), "median": float(np.median(v)), "mean": float(v.mean()),
            "max": int(v.max())}


def local_test_size(n: int, fraction: float) -> int:
    """Samples of a client of size ``n`` kept for its local test split: ``round(fraction n)``,
    at least one when ``fraction > 0``, and never all of them."""
    k = int(round(fraction * n))
    if n > 1:
        k = min(max(k, 1 if fraction > 0 else 0), n - 1)
    return k


def source_shape(src: Source) -> tuple[tuple[int, ...], torch.dtype]:
    """(row shape, dtype) of a source."""
    if isinstance(src, torch.Tensor):
        return tuple(src.shape[1:]), src.dtype
    if isinstance(src, np.ndarray):
        return tuple(src.shape[1:]), torch.from_numpy(src[:0].copy()).dtype
    return tuple(src.row_shape), src.dtype


def fill_rows(src: Source, index: np.ndarray, out: torch.Tensor) -> None:
    """``out[j] = src[index[j]]``, a chunk at a time (no full-size temporary)."""
    index = np.asarray(index, dtype=np.int64)
    if not isinstance(src, torch.Tensor | np.ndarray):
        src.fill(index, out)
        return
    for a in range(0, len(index), GATHER_CHUNK):
        idx = index[a:a + GATHER_CHUNK]
        if isinstance(src, torch.Tensor):
            torch.index_select(src, 0, torch.from_numpy(idx), out=out[a:a + len(idx)])
        else:
            out[a:a + len(idx)] = torch.from_numpy(np.ascontiguousarray(src[idx]))


def gather(src: Source, index: np.ndarray, name: str, disk: bool) -> torch.Tensor:
    """Rows ``index`` of ``src`` as a new tensor (memory, or the current store's disk)."""
    shape, dtype = source_shape(src)
    out = store.allocate(name, (len(index), *shape), dtype, disk)
    fill_rows(src, index, out)
    return out


def to_disk(rows: int, src: Source) -> bool:
    """Whether a split of ``rows`` rows shaped like ``src``'s goes to the store's disk."""
    s = store.current()
    if s is None:
        return False
    shape, dtype = source_shape(src)
    row_bytes = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
    return s.spill(rows * row_bytes)


def from_client_lists(
    name: str,
    num_classes: int,
    xs: list[torch.Tensor],
    ys: list[torch.Tensor],
    x_test: Source | None = None,
    y_test: torch.Tensor | None = None,
    local_test_fraction: float = 0.1,
    seed: int = 0,
    class_names: list[str] | None = None,
    scale: float | None = None,
) -> FederatedData:
    """Build the container from per-client samples, splitting each client 90/10 (default).

    Without a global test set, the union of the clients' local test splits is used.
    """
    return from_ranges(name, num_classes, torch.cat(xs), torch.cat(ys), [len(y) for y in ys],
                       x_test, y_test, local_test_fraction, seed, class_names, scale)


def from_ranges(
    name: str,
    num_classes: int,
    x: Source,
    y: torch.Tensor,
    sizes: list[int],
    x_test: Source | None = None,
    y_test: torch.Tensor | None = None,
    local_test_fraction: float = 0.1,
    seed: int = 0,
    class_names: list[str] | None = None,
    scale: float | None = None,
) -> FederatedData:
    """``from_partition`` where client k owns the k-th consecutive run of ``sizes[k]`` rows."""
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    parts = [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    return from_partition(name, num_classes, x, y, parts, x_test, y_test, local_test_fraction,
                          seed, class_names, scale=scale)


def from_partition(
    name: str,
    num_classes: int,
    x: Source,
    y: torch.Tensor,
    parts: list[np.ndarray],
    x_test: Source | None = None,
    y_test: torch.Tensor | None = None,
    local_test_fraction: float = 0.1,
    seed: int = 0,
    class_names: list[str] | None = None,
    *,
    labels: torch.Tensor | None = None,
    labels_test: torch.Tensor | None = None,
    scale: float | None = None,
    mean: tuple[float, ...] | None = None,
    std: tuple[float, ...] | None = None,
) -> FederatedData:
    """Build the container from a pool and per-client index arrays (a partitioner's output).

    Each client's samples are shuffled and split into local train and test parts (at least
    one test sample when the fraction is positive, at least one train sample); the pool is
    then gathered once per split, ordered by client, straight into the split arrays.
    ``scale``, ``mean``, ``std``: see ``FederatedData``. For segmentation, ``y`` and
    ``y_test`` are masks (kept in their dtype) and ``labels``/``labels_test`` the per-image
    object classes (gathered like ``y``).
    """
    rng = np.random.default_rng(seed)
    train, test = [], []
    for p in parts:
        p = rng.permutation(np.asarray(p, dtype=np.int64))
        n_test = local_test_size(len(p), local_test_fraction)
        test.append(p[:n_test])
        train.append(p[n_test:])
    train_offsets = np.concatenate([[0], np.cumsum([len(i) for i in train])])
    test_offsets = np.concatenate([[0], np.cumsum([len(i) for i in test])])
    tr = np.concatenate(train) if train else np.zeros(0, np.int64)
    te = np.concatenate(test) if test else np.zeros(0, np.int64)
    tr_t, te_t = torch.from_numpy(tr), torch.from_numpy(te)
    disk = to_disk(len(tr) + len(te) + (len(x_test) if x_test is not None else 0), x)
    x_local_test = gather(x, te, "x_local_test", disk)
    y_local_test = _target(y[te_t])
    lab = labels.long() if labels is not None else None
    if x_test is None:
        x_test, y_test = x_local_test, y_local_test
        labels_test = lab[te_t] if lab is not None else None
    elif not (isinstance(x_test, torch.Tensor) and not disk):
        x_test = gather(x_test, np.arange(len(x_test)), "x_test", disk)
    return FederatedData(
        name=name, num_classes=num_classes,
        x_train=gather(x, tr, "x_train", disk), y_train=_target(y[tr_t]),
        train_offsets=train_offsets, x_local_test=x_local_test, y_local_test=y_local_test,
        test_offsets=test_offsets, x_test=x_test, y_test=_target(y_test),
        class_names=class_names or [], scale=scale, mean=mean, std=std,
        labels_train=lab[tr_t] if lab is not None else None,
        labels_local_test=lab[te_t] if lab is not None else None,
        labels_test=labels_test.long() if labels_test is not None else None,
    )
