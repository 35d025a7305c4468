"""scikit-learn's wine recognition data as a federation (no download: it ships with
scikit-learn): 178 wines, 13 chemical measurements, 3 cultivars."""

from __future__ import annotations

import numpy as np
import torch
from protofl import DatasetSpec, FederatedData, config_partition, from_partition


def wine_federation(cfg) -> FederatedData:
    """Hold out a stratified 20% as the global test set; standardise with the training
    rows' statistics; split the rest over 10 clients (``data.partition``, default iid)."""
    from sklearn.datasets import load_wine
    from sklearn.model_selection import train_test_split

    d = load_wine()
    x_pool, x_test, y_pool, y_test = train_test_split(
        d.data.astype(np.float32), d.target.astype(np.int64), test_size=0.2,
        stratify=d.target, random_state=cfg.seed)
    mean, std = x_pool.mean(0), x_pool.std(0) + 1e-6
    parts = config_partition(y_pool, cfg, "iid", 10)
    return from_partition("wine", 3, torch.from_numpy((x_pool - mean) / std),
                          torch.from_numpy(y_pool), parts,
                          torch.from_numpy((x_test - mean) / std), torch.from_numpy(y_test),
                          cfg.local_test_fraction, cfg.seed,
                          class_names=[str(c) for c in d.target_names])


WINE = DatasetSpec(wine_federation, "resmlp", "scikit-learn's wine recognition data, 13 "
                   "features, 3 classes, 10 clients (no download)", needs_files=False,
                   partition="iid", ignores=("max_samples", "image_size"))
