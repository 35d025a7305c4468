import json

import pytest

from protofl.api import resume_experiment, run_experiment
from protofl.cli import main
from protofl.config import config_from_dict
from protofl.engine.runfolder import read_metrics

TINY = ["--rounds", "3", "--set", "clients.per_round=3", "--set", "data.num_clients=6",
        "--set", "clients.local_steps=2", "--set", "metrics.dissimilarity_clients=3"]


def _strip(rows):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]


def test_run_writes_a_run_folder(tmp_path):
    out = tmp_path / "run"
    assert main(["run", "-q", "--out", str(out), *TINY]) == 0
    for name in ("config.json", "metrics.jsonl", "summary.json", "checkpoint.safetensors",
                 "curves.png", "confusion.png", "stats.json", "stats.png"):
        assert (out / name).exists(), name
    rows = read_metrics(out)
    assert [r["round"] for r in rows] == [1, 2, 3]
    for key in ("accuracy", "loss", "seconds", "weights", "amm", "local_accuracy",
                "train_loss", "dissimilarity"):
        assert key in rows[-1]
    assert json.loads((out / "config.json").read_text())["algorithm"] == "fedmargin"
    assert json.loads((out / "stats.json").read_text())["clients"] == 6
    assert not (out / "weights").exists()  # fedmargin keeps no per-round weights by default


def test_same_seed_same_numbers(tmp_path):
    for name in ("a", "b"):
        assert main(["run", "-q", "--out", str(tmp_path / name), "--dataset", "digits",
                     "--algorithm", "fedprox", "--seed", "4", *TINY]) == 0
    assert _strip(read_metrics(tmp_path / "a")) == _strip(read_metrics(tmp_path / "b"))
    assert main(["run", "-q", "--out", str(tmp_path / "c"), "--dataset", "digits",
                 "--algorithm", "fedprox", "--seed", "5", *TINY]) == 0
    assert _strip(read_metrics(tmp_path / "a")) != _strip(read_metrics(tmp_path / "c"))


def test_resume_equals_uninterrupted(tmp_path, kill_after):
    raw = {"rounds": 5, "checkpoint_every": 2, "seed": 1,
           "data": {"num_clients": 6}, "clients": {"per_round": 3, "local_steps": 3,
                                                   "stragglers": 0.4},
           "metrics": {"dissimilarity_clients": 2}}
    run_experiment(config_from_dict(raw), tmp_path / "full")

    # killed during round 4, after the round-2 checkpoint
    with kill_after(3), pytest.raises(KeyboardInterrupt):
        run_experiment(config_from_dict(raw), tmp_path / "killed")
    assert [r["round"] for r in read_metrics(tmp_path / "killed")] == [1, 2, 3]
    resume_experiment(tmp_path / "killed")
    assert _strip(read_metrics(tmp_path / "killed")) == _strip(read_metrics(tmp_path / "full"))


@pytest.mark.parametrize("args, needle", [
    (["run", "--algorithm", "nope"], "unknown algorithm 'nope'"),
    (["run", "--dataset", "nope"], "unknown dataset 'nope'"),
    (["run", "--rounds", "-2"], "rounds"),
    (["run", "--set", "clients.per_round=99"], "per_round = 99 exceeds"),
    (["run", "--set", "clients.stragglers=1.5"], "clients.stragglers"),
    (["run", "--set", "bogus.key=1"], "unknown key 'bogus'"),
    (["run", "--dataset", "mnist"], "data.root"),
    (["run", "missing.yaml"], "missing.yaml"),
    (["run", "--resume", "/nonexistent/run"], "config.json"),
    (["compare", "/nonexistent"], "not a run folder"),
    (["suite", "nope"], "unknown suite"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle, capsys, tmp_path):
    assert main([*args, "--out", str(tmp_path / "o")] if args[0] == "run" and
                "--resume" not in args else args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_existing_run_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "-q", "--out", str(out), *TINY]) == 0
    before = (out / "metrics.jsonl").read_text()
    assert main(["run", "-q", "--out", str(out), *TINY, "--seed", "9"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == before


def test_compare_table_and_curves(tmp_path, capsys):
    for alg in ("fedavg", "fedatt"):
        for seed in (0, 1):
            assert main(["run", "-q", "--out", str(tmp_path / "runs" / f"{alg}{seed}"),
                         "--algorithm", alg, "--seed", str(seed), *TINY]) == 0
    assert main(["compare", str(tmp_path / "runs"), "--out", str(tmp_path / "t.md")]) == 0
    text = (tmp_path / "t.md").read_text()
    assert "| fedavg | 2 |" in text and "| fedatt | 2 |" in text and "±" in text
    assert list(tmp_path.glob("t_*.png"))


def test_listings(capsys):
    assert main(["algorithms"]) == 0
    out = capsys.readouterr().out
    assert "fedmargin" in out and "pgfl" in out and "Tan et al." in out
    assert "source:" not in out
    assert main(["algorithms", "--verbose"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if 'optimizer="adam"' in x)
    assert 'lr=0.0001' in line and "batch_size=128" in line and "local_epochs=5" in line
    assert "source: Kumar" in out and "influence=\"last_epoch\"" in out
    assert main(["datasets"]) == 0
    assert "synthetic" in capsys.readouterr().out
    assert main(["suites"]) == 0


def test_stats_command(tmp_path, capsys):
    assert main(["stats", "--dataset", "digits", "--set", "data.partition=classes",
                 "--set", "data.num_clients=20", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "20 clients" in out and "clients holding n classes: 2: 20" in out
    assert (tmp_path / "stats.png").exists()


def test_fedmargin_weights_plot_amm_correlation_and_tsne(tmp_path, capsys):
    import numpy as np

    for seed in (0, 1, 2):
        assert main(["run", "-q", "--out", str(tmp_path / "runs" / f"m{seed}"), "--seed",
                     str(seed), *TINY]) == 0
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "runs"), "--out", str(tmp_path / "t.md")]) == 0
    out = capsys.readouterr().out
    sums = [json.loads((tmp_path / "runs" / f"m{s}" / "summary.json").read_text())
            for s in (0, 1, 2)]
    rho = np.corrcoef([s["amm"] for s in sums], [s["accuracy"] for s in sums])[0, 1]
    assert f"Pearson rho(final AMM, accuracy) = {rho:.2f}" in out
    assert list(tmp_path.glob("t_*_weights.png"))
    assert main(["tsne", str(tmp_path / "runs" / "m0"), "--samples", "60"]) == 0
    assert (tmp_path / "runs" / "m0" / "tsne.png").exists()
