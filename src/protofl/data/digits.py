"""scikit-learn's bundled handwritten digits (8x8, 10 classes): the default image task."""

from __future__ import annotations

import numpy as np
import torch

from protofl.config import DataConfig
from protofl.data.federated import FederatedData, from_partition
from protofl.data.partition import config_partition

DIGITS_MAX = 16.0  # the bundled digits are 4-bit intensities 0..16


def digits_federation(cfg: DataConfig) -> FederatedData:
    """Hold out a stratified 20% as the global test set and partition the rest over clients."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = d.images.astype(np.uint8)[:, None]  # (N, 1, 8, 8) integers 0..16; inputs: / 16
    y = d.target.astype(np.int64)
    x_pool, x_test, y_pool, y_test = train_test_split(
        x, y, test_size=0.2, stratify=y, random_state=cfg.seed)
    parts = config_partition(y_pool, cfg, "dirichlet", 10)
    return from_partition("digits", 10, torch.from_numpy(x_pool), torch.from_numpy(y_pool),
                          parts, torch.from_numpy(x_test), torch.from_numpy(y_test),
                          cfg.local_test_fraction, cfg.seed, scale=DIGITS_MAX)
