"""Suites: the fedproin comparison trains fedproin with its paper's optimizer, the baselines
with the suite's shared local setup."""

from pathlib import Path

from protofl.algorithms.registry import algorithm_class
from protofl.config import config_from_dict, resolve_defaults
from protofl.suites import plan


def test_fedproin_suite_uses_fedproins_own_optimizer():
    seen = set()
    for raw, folder in plan("fedproin", Path("out"), seeds=(0,)):
        cfg = config_from_dict(raw)
        c = resolve_defaults(cfg.clients, algorithm_class(cfg.algorithm).client_defaults)
        want = ("adam", 1e-4) if cfg.algorithm == "fedproin" else ("adam", 1e-3)
        assert (c.optimizer, c.lr) == want, folder
        assert (c.local_steps, c.batch_size, c.momentum, c.weight_decay) == (10, 32, 0.0, 0.0)
        seen.add(cfg.algorithm)
    assert {"fedproin", "moon", "fedavg"} <= seen
