"""Run folders in use are locked, a run can be extended on resume, the last round always gets a
checkpoint, and divergence stops a run with one line (issue 13, wired into the engine)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from protofl.api import resume_experiment, run_experiment
from protofl.cli import main
from protofl.config import config_from_dict
from protofl.engine import runfolder
from protofl.engine.experiment import Experiment
from protofl.engine.train import ClientResult
from protofl.errors import Diverged
from protofl.testing import client_round, trained

RAW = {"algorithm": "fedavg", "seed": 3, "rounds": 3, "checkpoint_every": 1,
       "data": {"name": "digits", "num_clients": 4},
       "clients": {"per_round": 2, "local_steps": 1},
       "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 0}}


def rows(folder):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in runfolder.read_metrics(folder)]


def test_a_second_writer_is_refused_and_changes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    run_experiment(config_from_dict(RAW), out)
    before = (out / runfolder.METRICS).read_bytes()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from protofl.engine import runfolder\n"
         "with runfolder.lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)",
         str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        code = main(["run", "--resume", str(out), "--rounds", "4", "-q"])
        assert code == 2 and "in use by pid" in capsys.readouterr().err
        code = main(["run", "--algorithm", "fedavg", "--dataset", "digits", "--rounds", "1",
                     "--set", "data.num_clients=4", "--set", "clients.per_round=2",
                     "--out", str(out), "--overwrite", "-q"])
        assert code == 2
    finally:
        holder.kill()
        holder.wait()
    assert (out / runfolder.METRICS).read_bytes() == before
    time.sleep(0.1)
    assert main(["run", "--resume", str(out), "-q"]) == 0  # the lock went with its process


def test_resume_extends_a_run_to_more_rounds(tmp_path, capsys):
    # the costly figures (the clients' local accuracy) every round: a short run's last round
    # computes them, so a longer run must too for the records to match
    raw = {**RAW, "metrics": {**RAW["metrics"], "every": 1}}
    run_experiment(config_from_dict(raw), tmp_path / "short")
    resume_experiment(tmp_path / "short", rounds=5)
    run_experiment(config_from_dict({**raw, "rounds": 5}), tmp_path / "long")
    assert rows(tmp_path / "short") == rows(tmp_path / "long")
    assert json.loads((tmp_path / "short" / runfolder.CONFIG).read_text())["rounds"] == 5
    assert main(["run", "--resume", str(tmp_path / "short"), "--rounds", "2", "-q"]) == 2
    assert "already run 5 rounds" in capsys.readouterr().err
    for extra in (["--set", "clients.lr=0.5"], ["--seed", "0"], ["--algorithm", "fedprox"]):
        assert main(["run", "--resume", str(tmp_path / "short"), *extra, "-q"]) == 2
        assert "only --rounds" in capsys.readouterr().err


def test_checkpoint_every_zero_still_checkpoints_the_last_round(tmp_path):
    run_experiment(config_from_dict({**RAW, "checkpoint_every": 0}), tmp_path / "run")
    assert runfolder.load_checkpoint(tmp_path / "run")["round"] == 3


def test_resume_of_a_missing_folder_creates_nothing(tmp_path, capsys):
    assert main(["run", "--resume", str(tmp_path / "nope" / "run"), "-q"]) == 2
    assert "nothing to resume" in capsys.readouterr().err
    assert not (tmp_path / "nope").exists()


def test_non_finite_client_results_are_left_out(caplog):
    exp = Experiment(config_from_dict(RAW))
    c = client_round(exp.alg, exp.alg.broadcast(exp.state), *exp.client_inputs(0))
    good = exp.alg.client_end(trained(c, exp.state["params"], exp.state["buffers"]))[0]
    nan = {**good, "params": {k: torch.full_like(v, float("nan"))
                              for k, v in good["params"].items()}}
    kept, rejected = exp.screen([ClientResult(0, good, {}, 0.5), ClientResult(1, nan, {}, 0.5),
                                 ClientResult(2, good, {}, float("inf"))], 1)
    assert [r.client for r in kept] == [0] and rejected == [1, 2]
    assert "client 1 left out" in caplog.text and "NaN" in caplog.text


@pytest.mark.parametrize("every", [1, 10])
def test_divergence_stops_with_exit_3_and_keeps_the_last_checkpoint(tmp_path, capsys, every):
    out = tmp_path / "run"
    # NaN in round 3; rounds 1 and 2 are not evaluated (their test loss already explodes,
    # which stops a run at its first evaluation: tests/test_bad_inputs.py)
    code = main(["run", "--rounds", "6", "--set", "clients.lr=1000000.0",
                 "--set", f"checkpoint_every={every}", "--set", "eval_every=3",
                 "--set", "metrics.dissimilarity_clients=0", "--out", str(out), "-q"])
    err = capsys.readouterr().err
    assert code == Diverged.exit_code == 3
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "NaN/Inf" in errors[0] and "round 3" in errors[0]
    done = runfolder.read_metrics(out) if (out / runfolder.METRICS).exists() else []
    assert done == []  # no NaN round written as null
    if every == 1:  # the message names the checkpoint the folder keeps, or that it has none
        assert runfolder.load_checkpoint(out)["round"] == 2
        assert "keeps its checkpoint of round 2" in errors[0]
    else:
        assert not (out / runfolder.CHECKPOINT).exists()
        assert "has no checkpoint yet" in errors[0]
