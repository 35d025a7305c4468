"""The federated dataset container: each split is one contiguous tensor, clients are ranges."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from protofl.errors import ProtoflError


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
        counts = np.zeros((self.num_clients, self.num_classes), dtype=np.int64)
        if self.labels_train is not None and len(self.labels_train) != len(self.y_train):
            raise ProtoflError(f"{self.name}: labels_train does not match the training samples")
        y = (self.y_train if self.labels_train is None else self.labels_train).numpy()
        if y.ndim > 1:
            y = _present(y, self.num_classes)
        for k in range(self.num_clients):
            part = y[self.train_offsets[k] : self.train_offsets[k + 1]]
            counts[k] = (part.sum(0) if part.ndim > 1 else
                         np.bincount(part, minlength=self.num_classes))
        self.class_counts = counts  # (K, C) training samples per client and class

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

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """Model inputs from stored rows (every trainer and metric calls this on the rows it
        gathers before the model sees them)."""
        return x

    def client_train(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.train_offsets[k], self.train_offsets[k + 1]
        return self.x_train[a:b], self.y_train[a:b]

    def client_test(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.test_offsets[k], self.test_offsets[k + 1]
        return self.x_local_test[a:b], self.y_local_test[a:b]

    def pooled(self) -> FederatedData:
        """The same samples as one client holding every client's training and local test
        rows (the centralized baseline)."""
        return FederatedData(
            name=self.name, num_classes=self.num_classes, x_train=self.x_train,
            y_train=self.y_train, train_offsets=np.array([0, len(self.y_train)]),
            x_local_test=self.x_local_test, y_local_test=self.y_local_test,
            test_offsets=np.array([0, len(self.y_local_test)]), x_test=self.x_test,
            y_test=self.y_test, class_names=self.class_names)

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


def from_client_lists(
    name: str,
    num_classes: int,
    xs: list[torch.Tensor],
    ys: list[torch.Tensor],
    x_test: torch.Tensor | None = None,
    y_test: torch.Tensor | None = None,
    local_test_fraction: float = 0.1,
    seed: int = 0,
    class_names: list[str] | None = None,
) -> FederatedData:
    """Build the container from per-client samples, splitting each client 90/10 (default).

    Without a global test set, the union of the clients' local test splits is used.
    """
    bounds = np.concatenate([[0], np.cumsum([len(y) for y in ys])])
    parts = [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    return from_partition(name, num_classes, torch.cat(xs), torch.cat(ys), parts, x_test,
                          y_test, local_test_fraction, seed, class_names)


def from_partition(
    name: str,
    num_classes: int,
    x: torch.Tensor,
    y: torch.Tensor,
    parts: list[np.ndarray],
    x_test: torch.Tensor | None = None,
    y_test: torch.Tensor | None = None,
    local_test_fraction: float = 0.1,
    seed: int = 0,
    class_names: list[str] | None = None,
    labels: torch.Tensor | None = None,
    labels_test: torch.Tensor | None = None,
) -> FederatedData:
    """Build the container from a pool and per-client index arrays (a partitioner's output).

    Each client's samples are shuffled and split into local train and test parts (at least
    one test sample when the fraction is positive, at least one train sample); the pool is
    then gathered once per split, ordered by client. For segmentation, ``y`` and ``y_test``
    are masks (kept in their dtype) and ``labels``/``labels_test`` the per-image object
    classes (gathered like ``y``).
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
    tr = torch.from_numpy(np.concatenate(train))
    te = torch.from_numpy(np.concatenate(test))
    x_local_test, y_local_test = x[te], _target(y[te])
    lab = labels.long() if labels is not None else None
    if x_test is None:
        x_test, y_test = x_local_test, y_local_test
        labels_test = lab[te] if lab is not None else None
    return FederatedData(
        name=name, num_classes=num_classes,
        x_train=x[tr], y_train=_target(y[tr]), train_offsets=train_offsets,
        x_local_test=x_local_test, y_local_test=y_local_test, test_offsets=test_offsets,
        x_test=x_test, y_test=_target(y_test), class_names=class_names or [],
        labels_train=lab[tr] if lab is not None else None,
        labels_local_test=lab[te] if lab is not None else None,
        labels_test=labels_test.long() if labels_test is not None else None,
    )
