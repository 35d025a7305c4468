"""Run-folder integrity: one writer, clean --overwrite, torn metrics, history checks,
checkpoint cadence and pickle-free checkpoints."""

import json
import logging
import math
import os
import pickle
import socket
import subprocess
import time

import pytest
import torch

from protofl.engine import runfolder as rf
from protofl.errors import ProtoflError


def _in_child(fn) -> tuple[int, int]:
    """Fork a child that runs ``fn()`` and then sleeps; returns (pid, read end of a pipe on
    which the child writes one byte once ``fn`` has run, or 'E' + message if it raised)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            with fn():
                os.write(w, b"+")
                time.sleep(60)
        except ProtoflError as e:
            os.write(w, b"E" + str(e).encode())
        finally:
            os._exit(0)
    os.close(w)
    return pid, r


def _kill(pid: int) -> None:
    os.kill(pid, 9)
    os.waitpid(pid, 0)


def test_a_second_writer_gets_one_line_naming_the_holder(tmp_path):
    out = tmp_path / "run"
    pid, r = _in_child(lambda: rf.lock(out))
    try:
        assert os.read(r, 200) == b"+"
        with pytest.raises(ProtoflError) as e:  # e.g. `protofl run --resume` while it runs
            with rf.lock(out):
                pass
        msg = str(e.value)
        assert f"pid {pid} on {socket.gethostname()}" in msg and "\n" not in msg
        with pytest.raises(ProtoflError, match="in use"):  # `--overwrite` while it runs
            rf.prepare(out, overwrite=True)
    finally:
        _kill(pid)
    with rf.lock(out):  # the kernel released the dead child's lock
        pass


def test_lock_is_released_on_exit_and_reentrant(tmp_path):
    out = tmp_path / "run"
    with rf.lock(out), rf.lock(out):  # one process may nest it
        assert json.loads((out / rf.LOCK).read_text())["pid"] == os.getpid()
    assert (out / rf.LOCK).read_text() == ""
    pid, r = _in_child(lambda: rf.lock(out))
    try:
        assert os.read(r, 200) == b"+"
    finally:
        _kill(pid)


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path, caplog):
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (out / rf.LOCK).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    with caplog.at_level(logging.WARNING, "protofl"), rf.lock(out):
        assert json.loads((out / rf.LOCK).read_text())["pid"] == os.getpid()
    assert f"pid {dead.pid}, which is no longer running" in caplog.text


def test_two_fresh_runs_on_one_folder_one_wins(tmp_path):
    out = tmp_path / "run"

    class Fresh:
        def __enter__(self):
            self.cm = rf.lock(out)
            self.cm.__enter__()
            rf.prepare(out, overwrite=False)
            rf.write_json(out / rf.CONFIG, {"who": os.getpid()})

        def __exit__(self, *a):
            self.cm.__exit__(*a)

    kids = [_in_child(Fresh) for _ in range(2)]
    try:
        answers = sorted(os.read(r, 300)[:1] for _, r in kids)
    finally:
        for pid, _ in kids:
            _kill(pid)
    assert answers == [b"+", b"E"]


def test_prepare_says_what_to_do(tmp_path):
    out = tmp_path / "run"
    rf.prepare(out, overwrite=False)
    rf.write_json(out / rf.CONFIG, {})
    with pytest.raises(ProtoflError, match="before its first checkpoint.*--overwrite"):
        rf.prepare(out, overwrite=False)
    rf.save_checkpoint(out, {"round": 2})
    with pytest.raises(ProtoflError, match="--resume to continue"):
        rf.prepare(out, overwrite=False)
    rf.write_json(out / rf.SUMMARY, {})
    with pytest.raises(ProtoflError, match="--overwrite to replace"):
        rf.prepare(out, overwrite=False)
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path / "file", tmp_path / "file" / "run"):
        with pytest.raises(ProtoflError, match="file"):
            rf.prepare(bad, overwrite=False)


def test_overwrite_removes_every_artefact_and_only_those(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    for name in rf.ARTEFACTS:
        (out / name).write_text("old")
    (out / "metrics.jsonl.tmp").write_text("old")
    (out / "my-notes.txt").write_text("mine")
    rf.prepare(out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [rf.LOCK, "my-notes.txt"]
    assert "tsne.png" in rf.ARTEFACTS and "checkpoint.pt" in rf.ARTEFACTS


def _metrics(out, text):
    out.mkdir(exist_ok=True)
    (out / rf.METRICS).write_text(text)


def test_a_torn_last_line_is_dropped_and_reported(tmp_path, caplog):
    out = tmp_path / "run"
    _metrics(out, '{"round": 1, "accuracy": 0.5}\n{"round": 2, "accuracy": 0.6}\n{"round": 3, "acc')
    rows, torn = rf.read_metrics_checked(out)
    assert [r["round"] for r in rows] == [1, 2] and torn == '{"round": 3, "acc'
    with caplog.at_level(logging.WARNING, "protofl"):
        assert len(rf.read_metrics(out)) == 2
    assert "torn last line" in caplog.text
    rf.truncate_metrics(out, 2)  # what a resume does: the file is whole again
    assert (out / rf.METRICS).read_text().endswith('"accuracy": 0.6}\n')
    assert rf.read_metrics_checked(out).torn is None


@pytest.mark.parametrize("text, where", [
    ('{"round": 1}\n{"round": 2, "ac\n{"round": 3}\n', ":2 is not valid JSON"),
    ('{"round": 1}\n{"round": 2, "ac\n', ":2 is not valid JSON"),  # has its newline: not torn
    ('{"round": 1}\n[1, 2]\n', ":2 is not a metrics record"),
    ('{"round": "one"}\n', ":1 is not a metrics record"),
])
def test_a_corrupt_line_elsewhere_stays_an_error(tmp_path, text, where):
    _metrics(tmp_path / "run", text)
    with pytest.raises(ProtoflError, match=where):
        rf.read_metrics(tmp_path / "run")


def test_resume_refuses_a_lost_or_short_history(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    assert rf.evaluated_rounds(7, 3, 7) == [3, 6, 7]
    with pytest.raises(ProtoflError, match="missing.*round 6.*--overwrite"):
        rf.check_history(out, 6, 3, 10)  # metrics.jsonl deleted
    assert rf.check_history(out, 2, 3, 10) == []  # nothing evaluated before the checkpoint yet
    _metrics(out, '{"round": 3}\n')
    with pytest.raises(ProtoflError, match="lacks round 6"):
        rf.check_history(out, 6, 3, 10)
    _metrics(out, '{"round": 3}\n{"round": 6}\n{"round": 9}\n')
    assert [r["round"] for r in rf.check_history(out, 6, 3, 10)] == [3, 6, 9]


@pytest.mark.parametrize("every, last, expected", [
    (0, 5, [5]), (2, 5, [2, 4, 5]), (5, 5, [5]), (1, 3, [1, 2, 3]), (10, 4, [4]),
])
def test_should_checkpoint(every, last, expected):
    assert [t for t in range(1, last + 1) if rf.should_checkpoint(t, every, last)] == expected


def test_checkpoint_round_trip_without_pickle(tmp_path):
    payload = {"round": 3, "elapsed": 1.5, "nan": math.nan, "flag": True, "name": "x",
               "none": None, "state": {"params": {"w": torch.randn(3, 2).t(),
                                                  "n": torch.tensor(7)}},
               "client_states": {0: {"p": torch.ones(2, dtype=torch.float64)}, 5: {}},
               "pair": (1, [2.0, "three"]), "torch_rng": torch.get_rng_state()}
    rf.save_checkpoint(tmp_path, payload)
    assert sorted(p.name for p in tmp_path.iterdir()) == [rf.CHECKPOINT]
    back = rf.load_checkpoint(tmp_path)
    assert set(back) == set(payload) and list(back["client_states"]) == [0, 5]
    assert torch.equal(back["state"]["params"]["w"], payload["state"]["params"]["w"])
    assert back["state"]["params"]["n"].dtype == torch.int64
    assert back["client_states"][0]["p"].dtype == torch.float64
    assert torch.equal(back["torch_rng"], payload["torch_rng"])
    assert back["pair"] == (1, [2.0, "three"]) and math.isnan(back["nan"])
    assert (back["round"], back["flag"], back["none"]) == (3, True, None)
    with pytest.raises(TypeError, match="payload.bad"):
        rf.save_checkpoint(tmp_path, {"bad": object()})


class _Evil:
    """Unpickling this creates the marker file: the attack a pickled checkpoint allows."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("name", [rf.CHECKPOINT, rf.LEGACY_CHECKPOINT])
def test_a_malicious_checkpoint_runs_no_code(tmp_path, name):
    marker = tmp_path / "pwned"
    torch.save({"round": 1, "x": _Evil(marker)}, tmp_path / "evil.pt")
    torch.load(tmp_path / "evil.pt", weights_only=False)  # the old loader: the attack works
    assert marker.exists()
    marker.unlink()
    os.replace(tmp_path / "evil.pt", tmp_path / name)
    with pytest.raises(ProtoflError, match="cannot be read"):
        rf.load_checkpoint(tmp_path)
    assert not marker.exists()
    (tmp_path / name).write_bytes(pickle.dumps(_Evil(marker), protocol=2))  # a bare pickle
    with pytest.raises(ProtoflError, match="cannot be read"):
        rf.load_checkpoint(tmp_path)
    assert not marker.exists()


def test_a_legacy_checkpoint_of_plain_tensors_still_loads(tmp_path):
    torch.save({"round": 2, "state": {"w": torch.ones(2)}, "client_states": {1: {}}},
               tmp_path / rf.LEGACY_CHECKPOINT)
    back = rf.load_checkpoint(tmp_path)
    assert back["round"] == 2 and back["client_states"] == {1: {}}
    rf.save_checkpoint(tmp_path, back)  # the next save replaces the pickle
    assert not (tmp_path / rf.LEGACY_CHECKPOINT).exists()


def test_damaged_or_missing_checkpoint_is_one_line(tmp_path):
    with pytest.raises(ProtoflError, match="no checkpoint.*--overwrite"):
        rf.load_checkpoint(tmp_path)
    rf.save_checkpoint(tmp_path, {"round": 1, "w": torch.ones(4)})
    data = (tmp_path / rf.CHECKPOINT).read_bytes()
    for bad in (data[: len(data) // 2], data[:5], b"\xff" * 64, b""):
        (tmp_path / rf.CHECKPOINT).write_bytes(bad)
        with pytest.raises(ProtoflError, match="cannot be read"):
            rf.load_checkpoint(tmp_path)


def test_resume_after_a_kill_mid_write_of_metrics(tmp_path, kill_after, caplog):
    """A torn last line (a kill while appending) no longer blocks --resume."""
    from protofl import api as experiment  # run_experiment, resume_experiment
    from protofl.config import config_from_dict

    raw = {"rounds": 3, "checkpoint_every": 1, "seed": 2, "data": {"num_clients": 4},
           "clients": {"per_round": 2, "local_steps": 1},
           "metrics": {"dissimilarity_clients": 0}}
    experiment.run_experiment(config_from_dict(raw), tmp_path / "full")
    with kill_after(2), pytest.raises(KeyboardInterrupt):
        experiment.run_experiment(config_from_dict(raw), tmp_path / "killed")
    with open(tmp_path / "killed" / rf.METRICS, "a") as f:
        f.write('{"round": 3, "accura')
    experiment.resume_experiment(tmp_path / "killed")
    assert caplog.text.count("dropped a torn last line") == 1  # said once

    def strip(rows):
        return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]

    assert strip(rf.read_metrics(tmp_path / "killed")) == strip(rf.read_metrics(tmp_path / "full"))


def test_callbacks_see_a_read_only_view_and_the_store_writes_the_folder(tmp_path):
    """Every hook is given a frozen RoundView (never the Experiment); the run folder is the
    RunStore's, which the view lends (figures and side files go through it)."""
    import dataclasses

    from protofl.api import run_experiment
    from protofl.config import config_from_dict
    from protofl.engine.callbacks import Callback, RoundView
    from protofl.engine.runfolder import RunStore

    seen = []

    class Look(Callback):
        def before_run(self, view):
            seen.append(("before_run", type(view), view.store))
            assert not (tmp_path / "run" / "config.json").exists()  # nothing written yet

        def on_run_start(self, view):
            seen.append(("on_run_start", type(view), view.store))
            assert (tmp_path / "run" / "config.json").exists()

        def on_round_end(self, view, record):
            seen.append(("on_round_end", type(view), view.record is record))
            with pytest.raises(dataclasses.FrozenInstanceError):
                view.state = {}  # type: ignore[misc]

        def on_run_end(self, view, summary):
            seen.append(("on_run_end", type(view), view.store.summary() == json.loads(
                json.dumps(summary))))

    cfg = config_from_dict({"algorithm": "fedavg", "rounds": 2, "data": {"name": "digits",
                            "num_clients": 4}, "clients": {"per_round": 2, "local_steps": 1},
                            "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 0}})
    run_experiment(cfg, tmp_path / "run", callbacks=[Look()])
    assert [s[0] for s in seen] == ["before_run", "on_run_start", "on_round_end",
                                    "on_round_end", "on_run_end"]
    assert all(s[1] is RoundView for s in seen)
    assert isinstance(seen[0][2], RunStore) and seen[0][2].out == tmp_path / "run"
    assert seen[2][2] and seen[4][2]
    store = RunStore(tmp_path / "run")
    assert [r["round"] for r in store.records()] == [1, 2]
    assert store.checkpoint()["round"] == 2 and store.read_json("stats.json") is not None
    assert {"curves.png", "stats.png", "summary.json"} <= store.held()
