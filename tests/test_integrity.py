"""Run folders in use are locked, a run can be extended on resume, the last round always gets a
checkpoint, divergence stops a run with one line (issue 13, wired into the engine), and a
changed or corrupted run folder is refused by its manifest (issue 50)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time

import pytest
import torch

from protofl.api import resume_experiment, run_experiment
from protofl.cli import main
from protofl.config import config_from_dict
from protofl.engine import manifest, runfolder
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
    for extra in (["--seed", "0"], ["--algorithm", "fedprox"]):
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


# ---- the manifest (issue 50) ----
def test_digests_and_setting_changes_by_hand():
    assert manifest.digest(b"abc") == {"sha256": hashlib.sha256(b"abc").hexdigest(),
                                       "bytes": 3}
    # sha256("abc") from FIPS 180-2's example
    assert manifest.digest(b"abc")["sha256"].startswith("ba7816bf8f01cfea")
    old = {"rounds": 2, "clients": {"lr": 0.01, "per_round": 2}, "data": {"num_clients": 5}}
    new = {"rounds": 4, "clients": {"lr": 0.5, "per_round": 2}, "data": {"num_clients": 5},
           "extra": True}
    changes = manifest.setting_changes(old, new)
    assert changes == {"clients.lr": [0.01, 0.5], "extra": [None, True], "rounds": [2, 4]}
    assert manifest.said(changes, most=2) == "clients.lr 0.01 -> 0.5, extra null -> true and 1 more"


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 3-round run with its round weights (copied by each test that changes it)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    run_experiment(config_from_dict({**RAW, "metrics": {**RAW["metrics"], "save_weights": True}}),
                   out)
    return out


def copy(finished, tmp_path):
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


def test_a_finished_folder_verifies_and_records_every_file(finished, capsys):
    m = manifest.read(finished)
    assert sorted(m["files"]) == [runfolder.CHECKPOINT, runfolder.CONFIG, runfolder.METRICS,
                                  runfolder.PLAN, runfolder.SUMMARY,
                                  "weights/round_0001.safetensors",
                                  "weights/round_0002.safetensors",
                                  "weights/round_0003.safetensors"]
    for name in (runfolder.CHECKPOINT, runfolder.CONFIG, runfolder.METRICS, runfolder.PLAN,
                 runfolder.SUMMARY):
        data = (finished / name).read_bytes()  # an independent hash of each file
        assert m["files"][name]["sha256"] == hashlib.sha256(data).hexdigest()
    assert m["files"][runfolder.CHECKPOINT]["round"] == 3
    assert m["files"][runfolder.CONFIG]["settings"] == runfolder.load_config_json(finished)
    assert main(["verify", str(finished.parent)]) == 0
    assert capsys.readouterr().out.strip() == (f"{finished}: ok (8 files match their SHA-256; "
                                               "checkpoint of round 3)")


def test_a_hand_edited_config_is_refused_naming_the_settings(finished, tmp_path, capsys):
    out = copy(finished, tmp_path)
    cfg = json.loads((out / runfolder.CONFIG).read_text())
    cfg["data"]["num_clients"], cfg["clients"]["lr"] = 7, 0.5
    (out / runfolder.CONFIG).write_text(json.dumps(cfg))
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    for argv in (["run", "--resume", str(out), "--rounds", "5", "-q"], ["compare", str(out)],
                 ["report", str(out), "--out", str(tmp_path / "r.html")], ["verify", str(out)]):
        assert main(argv) == 2
        err = capsys.readouterr()
        line = (err.err or err.out).strip()
        assert "\n" not in line and "config.json was changed" in line, argv
        assert "clients.lr 0.01 -> 0.5, data.num_clients 4 -> 7" in line
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert not (tmp_path / "r.html").exists()
    # the same settings written otherwise (reformatted) change nothing
    (out / runfolder.CONFIG).write_text(json.dumps(runfolder.load_config_json(finished)))
    assert runfolder.RunStore(out).problems() == []


def flip(path, tensor, bit):
    """Flip ``bit`` of every float32 value of ``tensor``'s bytes in the file ``path``."""
    data = bytearray(path.read_bytes())
    raw = tensor.numpy().tobytes()
    at = bytes(data).find(raw)
    assert at > 0 and bytes(data).find(raw, at + 1) < 0
    for i in range(at + bit // 8, at + len(raw), 4):
        data[i] ^= 1 << (bit % 8)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("bit", [0, 30])  # the lowest mantissa bit; the top exponent bit
def test_a_flipped_bit_in_the_checkpoint_is_refused_not_blamed_on_the_lr(finished, tmp_path,
                                                                          capsys, bit):
    out = copy(finished, tmp_path)
    weight = runfolder.load_checkpoint(out)["state"]["params"]["fc.0.weight"]
    size = (out / runfolder.CHECKPOINT).stat().st_size
    flip(out / runfolder.CHECKPOINT, weight, bit)
    assert (out / runfolder.CHECKPOINT).stat().st_size == size
    back = runfolder.load_checkpoint(out)["state"]["params"]["fc.0.weight"]
    assert not torch.equal(back, weight)  # the header is intact: the file still loads
    assert main(["run", "--resume", str(out), "--rounds", "5", "-q"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.safetensors differs from round 3's checkpoint" in err
    assert "same size" in err and "lr" not in err and "diverged" not in err
    assert runfolder.read_metrics(out)[-1]["round"] == 3  # nothing was run


def test_an_edited_metric_line_or_summary_is_refused_by_compare_and_report(finished, tmp_path,
                                                                           capsys):
    out = copy(finished, tmp_path)
    text = (out / runfolder.METRICS).read_text()
    assert '"accuracy": 0.' in text
    (out / runfolder.METRICS).write_text(text.replace('"accuracy": 0.', '"accuracy": 1.', 1))
    assert main(["compare", str(out)]) == 2
    assert "metrics.jsonl: its lines up to round 3 differ" in capsys.readouterr().err
    (out / runfolder.METRICS).write_text(text[:-50])
    assert main(["compare", str(out)]) == 2
    assert "metrics.jsonl is shorter than the" in capsys.readouterr().err
    shutil.copy(finished / runfolder.METRICS, out / runfolder.METRICS)
    (out / runfolder.SUMMARY).write_text((finished / runfolder.SUMMARY).read_text()
                                         .replace('"rounds": 3', '"rounds": 30'))
    assert main(["report", str(out), "--out", str(tmp_path / "r.html")]) == 2
    assert "summary.json differs from the file protofl wrote" in capsys.readouterr().err
    shutil.copy(finished / runfolder.SUMMARY, out / runfolder.SUMMARY)
    (out / "weights" / "round_0002.safetensors").unlink()
    assert main(["verify", str(out)]) == 2
    assert "weights/round_0002.safetensors is missing" in capsys.readouterr().out


def test_a_deliberate_change_on_resume_is_recorded_and_fixed_settings_are_refused(
        finished, tmp_path, capsys):
    out = copy(finished, tmp_path)
    assert main(["run", "--resume", str(out), "--rounds", "4", "--set", "data.num_clients=7",
                 "-q"]) == 2
    assert "data.num_clients cannot change on resume (4 -> 7)" in capsys.readouterr().err
    assert main(["run", "--resume", str(out), "--rounds", "4", "--set", "clients.lr=0.5",
                 "-q"]) == 0
    m = manifest.read(out)
    assert m["history"] == [{"round": 3, "changed": {"clients.lr": [0.01, 0.5],
                                                      "rounds": [3, 4]}}]
    assert runfolder.load_config_json(out)["clients"]["lr"] == 0.5
    capsys.readouterr()
    assert main(["verify", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == (f"{out}: settings changed on resume after round 3: clients.lr 0.01 -> "
                        "0.5, rounds 3 -> 4")
    # a resume that changes nothing records nothing
    assert main(["run", "--resume", str(out), "-q"]) == 0
    assert len(manifest.read(out)["history"]) == 1


def test_a_kill_between_the_manifest_and_the_checkpoint_still_resumes_exactly(tmp_path,
                                                                              monkeypatch):
    real = runfolder.os.replace

    def dying(src, dst):  # killed once the manifest names round 2's checkpoint
        if str(dst).endswith(runfolder.CHECKPOINT) and manifest.read(tmp_path / "run")[
                "files"][runfolder.CHECKPOINT]["round"] == 2:
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(runfolder.os, "replace", dying)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(config_from_dict(RAW), tmp_path / "run")
    monkeypatch.setattr(runfolder.os, "replace", real)
    assert runfolder.load_checkpoint(tmp_path / "run")["round"] == 1  # the previous one
    assert runfolder.RunStore(tmp_path / "run").problems() == []
    resume_experiment(tmp_path / "run")
    run_experiment(config_from_dict(RAW), tmp_path / "whole")
    assert rows(tmp_path / "run") == rows(tmp_path / "whole")
    assert runfolder.RunStore(tmp_path / "run").problems() == []


def test_a_folder_written_before_manifests_is_read_with_a_warning_and_gets_one(
        finished, tmp_path, capsys, caplog):
    out = copy(finished, tmp_path)
    (out / manifest.MANIFEST).unlink()
    assert main(["verify", str(out)]) == 1
    assert "not checked: no manifest.json" in capsys.readouterr().out
    assert main(["compare", str(out)]) == 0
    assert "have no manifest.json" in caplog.text
    resume_experiment(out, rounds=4)
    assert "it gets one now" in caplog.text
    assert runfolder.RunStore(out).verify()["files"][runfolder.CHECKPOINT]["round"] == 4
