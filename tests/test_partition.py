import numpy as np
import pytest

from protofl.data.partition import partition, power_law_sizes
from protofl.errors import ProtoflError

Y = np.repeat(np.arange(10), 60)  # 600 samples, 10 classes


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "dirichlet_powerlaw"])
def test_every_sample_used_once(scheme):
    parts = partition(Y, scheme, 12, seed=0, alpha=0.5)
    allidx = np.concatenate(parts)
    assert len(allidx) == len(np.unique(allidx)) == len(Y)


def test_iid_sizes_equal_and_seeded():
    a = partition(Y, "iid", 6, seed=1)
    assert [len(p) for p in a] == [100] * 6
    b = partition(Y, "iid", 6, seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    c = partition(Y, "iid", 6, seed=2)
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_classes_per_client_holds_exactly_k():
    parts = partition(Y, "classes", 20, seed=0, classes=2, min_size=4)
    for p in parts:
        assert len(np.unique(Y[p])) == 2


def test_dirichlet_small_alpha_is_skewed():
    low = partition(Y, "dirichlet", 10, seed=0, alpha=0.05)
    high = partition(Y, "dirichlet", 10, seed=0, alpha=100.0)
    mean_classes = lambda ps: np.mean([len(np.unique(Y[p])) for p in ps])  # noqa: E731
    assert mean_classes(low) < 5 < mean_classes(high)


def test_power_law_sizes():
    rng = np.random.default_rng(0)
    s = power_law_sizes(10_000, 500, 3.0, 5, rng)
    assert s.sum() == 10_000 and s.min() >= 5
    assert s.max() > 10 * np.median(s) / 2  # heavy right tail
    with pytest.raises(ProtoflError):
        power_law_sizes(10, 5, 3.0, 5, rng)


def test_bad_partition_requests():
    with pytest.raises(ProtoflError, match="unknown partition"):
        partition(Y, "nope", 3, seed=0)
    with pytest.raises(ProtoflError, match="num_clients"):
        partition(Y, "iid", 0, seed=0)
    with pytest.raises(ProtoflError, match="alpha"):
        partition(Y, "dirichlet", 3, seed=0, alpha=0)


def test_config_partition_and_cap_follow_the_config():
    from protofl.config import DataConfig
    from protofl.data.partition import capped, config_partition

    cfg = DataConfig(partition=None, num_clients=None, max_samples=50, seed=3)
    parts = config_partition(Y, cfg, "classes", 20)  # the dataset's defaults
    assert len(parts) == 20 and all(len(np.unique(Y[p])) == 2 for p in parts)
    assert len(config_partition(Y, DataConfig(partition="iid", num_clients=4), "classes",
                                20)) == 4
    keep = capped(600, cfg)
    assert len(keep) == 50 and np.all(np.diff(keep) > 0)
    assert np.array_equal(keep, capped(600, cfg)) and len(capped(30, cfg)) == 30
