"""Suite planning: the FFD reference runs come first and every other run reads its own; the
fedproin comparison trains fedproin with its paper's optimizer, the baselines with the
suite's shared local setup."""

from pathlib import Path

from protofl.algorithms.registry import algorithm_class
from protofl.config import config_from_dict
from protofl.engine.spec import fill
from protofl.suites import phases, plan


def test_main_plans_a_central_reference_per_dataset_and_seed(tmp_path):
    jobs = plan("main", tmp_path, seeds=(0, 1), overrides={"rounds": 3})
    central = [(raw, Path(f)) for raw, f in jobs if raw["algorithm"] == "central"]
    assert sorted(f.relative_to(tmp_path).as_posix() for _, f in central) == [
        "digits-noniid/central/seed0", "digits-noniid/central/seed1",
        "synthetic/central/seed0", "synthetic/central/seed1"]
    assert all(raw["rounds"] == 3 for raw, _ in jobs)  # overrides reach the references too
    for raw, folder in jobs:
        config_from_dict(raw)  # every planned config is valid
        if raw["algorithm"] == "central":
            assert "ffd_reference" not in raw.get("metrics", {})
            continue
        ref = Path(raw["metrics"]["ffd_reference"])
        ds, seed = Path(folder).relative_to(tmp_path).parts[0], Path(folder).name
        assert ref == (tmp_path / ds / "central" / seed).resolve()
    first, rest = phases(jobs)
    assert {f for _, f in first} == {str(f) for _, f in central}
    assert len(first) + len(rest) == len(jobs)


def test_suites_without_ffd_run_in_one_phase(tmp_path):
    jobs = plan("fedproin", tmp_path, seeds=(0,))
    assert all(raw["algorithm"] != "central" for raw, _ in jobs)
    assert phases(jobs) == [jobs]
    # a suite whose references are already finished has only the second phase left
    main = plan("main", tmp_path, seeds=(0,))
    assert phases([j for j in main if j[0]["algorithm"] != "central"]) == [
        [j for j in main if j[0]["algorithm"] != "central"]]


def test_fedproin_suite_uses_fedproins_own_optimizer():
    """fedproin trains with its paper's optimizer, once with the suite's local work and once
    with its paper's too (batch 128, E = 5); the baselines share the suite's."""
    seen = set()
    for raw, folder in plan("fedproin", Path("out"), seeds=(0,)):
        cfg = config_from_dict(raw)
        c = fill(cfg.clients, algorithm_class(cfg.algorithm).client_defaults)
        want = ("adam", 1e-4) if cfg.algorithm == "fedproin" else ("adam", 1e-3)
        assert (c.optimizer, c.lr) == want, folder
        row = Path(folder).parent.name
        work = (None, 128, 5) if row == "fedproin-paper" else (10, 32, c.local_epochs)
        assert (c.local_steps, c.batch_size, c.local_epochs) == work, folder
        assert (c.momentum, c.weight_decay) == (0.0, 0.0)
        seen.add(row)
    assert {"fedproin", "fedproin-paper", "moon", "fedavg"} <= seen
