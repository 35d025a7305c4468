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


# ------------------------------------------- heterogeneous --budget paper: HtFLlib's protocol
PAPER = "heterogeneous-paper"


def _by_dataset(jobs, root):
    out: dict[str, dict[str, list[dict]]] = {}
    for raw, folder in jobs:
        ds, run, _ = Path(folder).relative_to(root).parts
        out.setdefault(ds, {}).setdefault(run, []).append(raw)
    return out


def test_the_paper_plan_holds_every_heterogeneous_method_at_5_seeds(tmp_path):
    from protofl.engine.hetero import capable
    from protofl.suites import not_run
    from protofl.suites_hetero import PAPER_DATASETS

    plans = _by_dataset(plan(PAPER, tmp_path), tmp_path)
    # the CIFAR sets where their data are (none on the build machine), the stand-in always
    assert set(plans) == set(PAPER_DATASETS) - set(not_run(PAPER))
    assert "cifar_tiny-dir0.1-reduced" in plans
    for runs in plans.values():
        assert set(runs) == set(capable()) >= {"fedproto", "fedtgp", "fedproin", "fd",
                                                "lgfedavg", "fedgh", "fml", "fpl"}
        for label, raws in runs.items():
            assert [r["seed"] for r in raws] == [0, 1, 2, 3, 4]
            assert all(r["algorithm"] == label for r in raws)
            for r in raws:
                config_from_dict(r)


def test_a_method_registered_later_joins_the_paper_plan(tmp_path, monkeypatch):
    """The method list is read from the registry when the suite is planned: a personalised
    algorithm registered after import is planned, one that averages weights is not."""
    from protofl.algorithms import registry

    monkeypatch.setitem(registry.ALGORITHMS, "fakehet", "protofl.algorithms.fedproto:FedProto")
    monkeypatch.setitem(registry.ALGORITHMS, "fakeavg", "protofl.algorithms.fedavg:FedAvg")
    runs = _by_dataset(plan(PAPER, tmp_path, seeds=(0,)), tmp_path)["cifar_tiny-dir0.1-reduced"]
    assert "fakehet" in runs and "fakeavg" not in runs
    assert runs["fakehet"][0]["algorithm"] == "fakehet"
    monkeypatch.delitem(registry.ALGORITHMS, "fakehet")
    runs = _by_dataset(plan(PAPER, tmp_path, seeds=(0,)), tmp_path)["cifar_tiny-dir0.1-reduced"]
    assert "fakehet" not in runs


def test_the_paper_protocol_is_htfllibs(tmp_path):
    """HtFLlib's system/total.sh and main.py defaults, PFLlib's data split; every method
    trains with the protocol's local setup, not its own paper's (fpl: momentum 0.9, fedproin:
    Adam), and with total.sh's flags for it."""
    from protofl.suites_hetero import CIFAR10, CIFAR100, ROUNDS_STAND_IN, STAND_IN

    for base, name in ((CIFAR10, "cifar10"), (CIFAR100, "cifar100")):
        d, c = base["data"], base["clients"]
        assert (d["name"], d["num_clients"], d["partition"], d["alpha"]) == (
            name, 20, "dirichlet", 0.1)
        assert (d["local_test_fraction"], d["augment"]) == (0.25, "none")
        assert (c["per_round"], c["local_epochs"], c["batch_size"]) == (20, 1, 10)
        assert (c["optimizer"], c["lr"], c["momentum"], c["weight_decay"]) == (
            "sgd", 0.01, 0.0, 0.0)
        assert base["model"] == {"family": "htfe-img-8", "feature_dim": 512}
        assert (base["rounds"], base["eval_every"]) == (2000, 1)
    # the stand-in: the same split and local training, reduced where it must be
    assert STAND_IN["data"]["name"] == "cifar_tiny" and STAND_IN["data"]["num_clients"] == 10
    assert STAND_IN["clients"] == {**CIFAR10["clients"], "per_round": 10}
    assert {k: v for k, v in STAND_IN["data"].items() if k not in ("name", "num_clients")} == {
        k: v for k, v in CIFAR10["data"].items() if k not in ("name", "num_clients", "root")}
    assert STAND_IN["rounds"] == ROUNDS_STAND_IN < 2000
    want = {"fedproto": {"lam": 10.0},
            "fedtgp": {"lam": 10.0, "server_epochs": 100, "margin_cap": 100.0},
            "fd": {"lam": 1.0}, "fml": {"alpha": 0.5, "beta": 0.5},
            "fedgh": {"server_lr": 0.01, "server_epochs": 1}, "lgfedavg": {}}
    for raw, folder in plan(PAPER, tmp_path, seeds=(0,)):
        cfg, c = _resolved(raw)
        if cfg.algorithm in want:
            assert cfg.algo == want[cfg.algorithm], folder
        assert (c.optimizer, c.lr, c.momentum, c.weight_decay, c.batch_size,
                c.local_epochs, c.local_steps) == ("sgd", 0.01, 0.0, 0.0, 10, 1, None), folder


def test_htfllibs_flags_are_mapped_for_every_registered_method():
    """Each heterogeneous-capable method has its PAPER_ALGO entry, and it names options its
    method declares."""
    from protofl.config import build
    from protofl.engine.hetero import capable, variant
    from protofl.suites_hetero import PAPER_ALGO

    assert set(capable()) <= set(PAPER_ALGO), sorted(set(capable()) - set(PAPER_ALGO))
    for name in capable():
        build(variant(name).Options, dict(PAPER_ALGO[name]), "algo")  # unknown keys raise


def _fake_cifar10(root: Path) -> Path:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for n in (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"):
        (folder / n).write_bytes(b"")
    return folder


def test_the_paper_suite_runs_a_cifar_set_only_where_its_data_are(tmp_path):
    from protofl.suites import not_run

    absent = not_run(PAPER, {"data": {"root": str(tmp_path / "nowhere")}})
    assert set(absent) == {"cifar10-dir0.1", "cifar100-dir0.1"}
    assert all(v.startswith("not run here: needs ") for v in absent.values())
    assert "protofl data fetch cifar100" in absent["cifar100-dir0.1"]
    (tmp_path / "empty").mkdir()  # a folder without the batches is absent data too
    assert set(not_run(PAPER, {"data": {"root": str(tmp_path / "empty")}})) == set(absent)
    root = _fake_cifar10(tmp_path / "cifar10")  # the layout the loader checks
    over = {"data": {"root": str(root)}}
    assert set(not_run(PAPER, over)) == {"cifar100-dir0.1"}
    jobs = _by_dataset(plan(PAPER, tmp_path / "out", seeds=(0,), overrides=over),
                       tmp_path / "out")
    assert set(jobs) == {"cifar10-dir0.1", "cifar_tiny-dir0.1-reduced"}
    raw = jobs["cifar10-dir0.1"]["fedproto"][0]
    assert raw["data"]["name"] == "cifar10" and raw["model"]["family"] == "htfe-img-8"


def test_the_paper_suite_runs_end_to_end(tmp_path, monkeypatch):
    """Two methods, 1 round, 1 seed: the table, the curves, and the absent CIFAR sets said
    in the table."""
    from protofl.engine import hetero
    from protofl.suites import run_suite

    monkeypatch.setattr(hetero, "capable", lambda: ["fedproto", "fd"])
    over = {"rounds": 1, "eval_every": 1, "checkpoint_every": 0,
            "data": {"root": str(tmp_path / "no-cifar")}}  # the stand-in only, wherever run
    text = run_suite(PAPER, tmp_path, jobs=1, seeds=(0,), overrides=over)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "cifar_tiny-dir0.1-reduced"]
    for m in ("fedproto", "fd"):
        assert (tmp_path / "cifar_tiny-dir0.1-reduced" / m / "seed0" / "summary.json").is_file()
    table = (tmp_path / "table.md").read_text()
    assert "| fedproto |" in table and "| fd |" in table
    assert "cifar100-dir0.1: not run here: needs" in table and "not run here" in text
    assert list(tmp_path.glob("table_*.png")) and (tmp_path / "report.html").is_file()
