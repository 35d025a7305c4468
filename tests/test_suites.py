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


def _resolved(raw):
    cfg = config_from_dict(raw)
    return cfg, fill(cfg.clients, algorithm_class(cfg.algorithm).client_defaults)


def test_every_suites_fedavg_samples_uniformly():
    """FedAvg is the seed's FedAvg in every suite: uniform client sampling; size-weighted
    sampling only in rows labelled so (issue 21)."""
    from protofl.suites import SUITES

    seen = 0
    for name in SUITES:
        for raw, folder in plan(name, Path("out"), seeds=(0,)):
            cfg, c = _resolved(raw)
            weighted_fedavg = (cfg.algorithm == "fedavg"
                               or cfg.algo.get("weights") == "fedavg")
            if weighted_fedavg and "size-sampled" not in folder:
                assert c.sampling == "uniform", folder
                seen += 1
    assert seen >= 5


def test_ablation_rows_map_to_the_seeds_table3():
    rows = {Path(f).parent.name: _resolved(raw)
            for raw, f in plan("fedmargin-ablation", Path("out"), seeds=(0,))}

    def switches(label):
        cfg, c = rows[label]
        return cfg.algo.get("weights", "attention"), c.sampling, c.tolerate_partial

    assert switches("1-fedavg") == ("fedavg", "uniform", False)  # FedAvg itself
    assert switches("1b-fedavg-size-sampled") == ("fedavg", "weighted", False)
    assert switches("2-fairness") == ("fair", "weighted", False)
    # row 3: the fair policy with i.i.d. sampling ("comparable to FedAvg"), not FedAvg again
    assert switches("3-fairness-iid-sampling") == ("fair", "uniform", False)
    assert switches("4-fedavg+toleration") == ("fedavg", "uniform", True)
    assert switches("5-fairness+toleration") == ("fair", "weighted", True)
    assert switches("6-full-no-toleration") == ("attention", "weighted", False)
    assert switches("10-full") == ("attention", "weighted", True)
    first = [k for k in rows if k.split("-")[0] in ("1", "1b", "2", "3", "4", "5", "6")]
    assert len({switches(k) for k in first}) == len(first) == 7  # no row repeats another


def test_seeds_vary_the_partition():
    """data.seed follows the run seed in every suite (an override still wins)."""
    from protofl.suites import SUITES

    for name in SUITES:
        for raw, _ in plan(name, Path("out"), seeds=(0, 3)):
            assert raw["data"]["seed"] == raw["seed"]
    jobs = plan("main", Path("out"), seeds=(3,), overrides={"data": {"seed": 7}})
    assert {raw["data"]["seed"] for raw, _ in jobs} == {7}


def test_partition_per_seed_does_not_split_table_rows():
    from protofl.report.labels import row_labels

    flats = [{"seed": s, "data.seed": s, "clients.lr": 0.1} for s in range(3)]
    labels, _ = row_labels(["fedavg"] * 3, flats)
    assert labels == ["fedavg"] * 3
    flats[2]["data.seed"] = 0  # a partition chosen apart from the seed still shows
    assert len(set(row_labels(["fedavg"] * 3, flats)[0])) == 2
