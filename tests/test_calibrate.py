"""Measured trainer costs (engine/calibrate.py), the recorded plan (plan.jsonl) and its
replay, and the cache folder's command."""

import json
import logging
import math

import pytest
import torch

from protofl.api import resume_experiment, run_experiment
from protofl.cli import main
from protofl.config import config_from_dict
from protofl.engine import cache, calibrate, costs
from protofl.engine.runfolder import PLAN, RunStore, read_metrics, read_plan
from protofl.engine.trainers import Plan

# per-step costs with the arithmetic folded in: one makes plain steps cheapest, one vmap
PLAIN_WINS = {"plain": 1e-4, "vmap": 1.0, "vmap_client": 1.0, "thread_sync": 1.0}
VMAP_WINS = {"plain": 1.0, "vmap": 1e-4, "vmap_client": 1e-5, "compiled_client": 1.0,
             "thread_sync": 1.0}


def _raw(**extra):
    return {"algorithm": "fedavg", "rounds": 3, "checkpoint_every": 1, "workers": 1,
            "data": {"name": "digits", "num_clients": 5},
            "clients": {"per_round": 3, "local_steps": 2},
            "metrics": {"dissimilarity_clients": 0}, **extra}


def _strip(rows):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """Calibration on, in a cache of the test's own; ``measured(costs)`` sets what the next
    measurement gives (no timing) and empties the cache."""
    monkeypatch.setenv("PROTOFL_CALIBRATE", "1")
    monkeypatch.setenv("PROTOFL_CACHE", str(tmp_path / "cache"))

    def use(table: dict) -> None:
        cache.clear(("calibration",))
        monkeypatch.setattr(calibrate, "measure",
                            lambda rc, names, compile=False, compiled=None: dict(table))

    return use


def test_a_calibrated_table_folds_the_arithmetic_in():
    table = calibrate.table({"plain": 1e-3, "vmap": 2e-3, "vmap_client": 1e-4}, "cpu")
    assert table["rate"] == math.inf and table["fork"] == costs.CPU["fork"]
    work = costs.Work((4, 4, 4), 10, 1e6, table=table)
    assert work.arithmetic() == 0.0
    # plain steps of 1 and 2 clients (1e-3, 2e-3) cost no more than one vmap step (2.1e-3,
    # 2.2e-3); of 3 (3e-3) more than it (2.3e-3): 4 steps of 3 clients by vmap
    assert costs.solo_max(work) == 2
    assert costs.vectorized_seconds(work) == pytest.approx(4 * (2e-3 + 3 * 1e-4))
    assert costs.sequential_seconds(work) == pytest.approx(12 * 1e-3)


def test_measure_times_each_trainer_and_leaves_the_generator(tiny_round):
    state = torch.get_rng_state()
    found = calibrate.measure(tiny_round, ["sequential", "vectorized", "compiled"])
    assert torch.equal(torch.get_rng_state(), state)
    assert {"plain", "vmap", "vmap_client", "compiled_client"} <= set(found)
    assert all(v >= 0 and math.isfinite(v) for v in found.values())
    assert "compile" not in found  # no compile unless asked (protofl calibrate)


@pytest.fixture
def tiny_round():
    from protofl.engine.experiment import Experiment
    from protofl.engine.train import RoundContext

    exp = Experiment(config_from_dict(_raw()), callbacks=[])
    return RoundContext(exp.alg, exp.alg.broadcast(exp.state), [], exp.train_data, {},
                        exp.setup, 1)


def test_the_key_is_the_machine_and_the_model(tiny_round):
    import dataclasses

    mach, sig = calibrate.machine(torch.device("cpu")), calibrate.signature(tiny_round)
    other = dataclasses.replace(tiny_round, setup=dataclasses.replace(tiny_round.setup,
                                                                      batch_size=7))
    assert calibrate.key_of(mach, sig) == calibrate.key_of(dict(mach), dict(sig))
    assert calibrate.key_of(mach, sig) != calibrate.key_of(mach, calibrate.signature(other))
    assert calibrate.key_of(mach, sig) != calibrate.key_of({**mach, "torch": "0.0"}, sig)


def test_a_damaged_cache_falls_back_to_the_constants_in_one_line(measured, tiny_round,
                                                                 caplog):
    measured(PLAIN_WINS)
    table, hashed = calibrate.costs_for(tiny_round, ["sequential", "vectorized"])
    assert table["plain"] == PLAIN_WINS["plain"] and hashed == calibrate.digest(PLAIN_WINS)
    [path] = calibrate.folder().glob("*.json")
    assert json.loads(path.read_text())["measured"] == PLAIN_WINS
    # read back, not measured again
    assert calibrate.costs_for(tiny_round, ["sequential"])[1] == hashed
    path.write_text('{"version": 1, "measured": {"plain": "fast"')
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="protofl"):
        assert calibrate.costs_for(tiny_round, ["sequential"]) == (None, None)
    [line] = [r.getMessage() for r in caplog.records]
    assert "cannot be read" in line and "fixed cost constants" in line
    assert "\n" not in line


def test_the_plan_is_recorded_and_replayed_bit_for_bit(measured, tmp_path):
    measured(PLAIN_WINS)
    run_experiment(config_from_dict(_raw()), tmp_path / "a")
    plan = read_plan(tmp_path / "a")
    assert plan.rounds == {1: "sequential", 2: "sequential", 3: "sequential"}
    assert plan.calibration == calibrate.digest(PLAIN_WINS) and plan.table["rate"] == math.inf
    assert RunStore(tmp_path / "a").problems() == []  # the manifest covers plan.jsonl

    measured(VMAP_WINS)  # another machine's costs
    run_experiment(config_from_dict(_raw()), tmp_path / "c")
    assert set(read_plan(tmp_path / "c").rounds.values()) == {"vectorized"}
    run_experiment(config_from_dict(_raw(trainer_plan=str(tmp_path / "a"))), tmp_path / "b")
    assert read_plan(tmp_path / "b").rounds == plan.rounds
    assert _strip(read_metrics(tmp_path / "b")) == _strip(read_metrics(tmp_path / "a"))

    path = tmp_path / "a" / PLAN
    path.write_text(path.read_text().replace('"sequential"', '"vectorized"', 1))
    assert any(PLAN in p for p in RunStore(tmp_path / "a").problems())


def test_resume_replays_the_killed_runs_plan(measured, tmp_path, kill_after):
    measured(PLAIN_WINS)
    run_experiment(config_from_dict(_raw()), tmp_path / "full")
    with kill_after(1), pytest.raises(KeyboardInterrupt):
        run_experiment(config_from_dict(_raw()), tmp_path / "killed")
    measured(VMAP_WINS)  # the cache changed meanwhile: the recorded costs still decide
    resume_experiment(tmp_path / "killed")
    assert read_plan(tmp_path / "killed").rounds == read_plan(tmp_path / "full").rounds
    assert (_strip(read_metrics(tmp_path / "killed"))
            == _strip(read_metrics(tmp_path / "full")))
    assert RunStore(tmp_path / "killed").problems() == []


def test_calibrate_false_keeps_the_constants(measured, tmp_path):
    measured(VMAP_WINS)
    run_experiment(config_from_dict(_raw(calibrate=False)), tmp_path / "a")
    assert read_plan(tmp_path / "a").calibration is None
    assert not list(calibrate.folder().glob("*.json"))


@pytest.mark.parametrize("trainer", ["sequential", "vectorized", "parallel"])
def test_a_named_trainer_is_recorded_for_every_round(tmp_path, trainer):
    """A run on one named trainer (the parallel one's ``inner`` is a name, not a wrapper)."""
    run_experiment(config_from_dict(_raw(trainer=trainer, workers=2, rounds=2)), tmp_path / "a")
    plan = read_plan(tmp_path / "a")
    assert plan.rounds == {1: trainer, 2: trainer} and plan.calibration is None


def test_read_plan_keeps_rounds_up_to(tmp_path):
    (tmp_path / PLAN).write_text(
        '{"calibration": "abc", "costs": {"plain": 1.0, "rate": null}}\n'
        '{"round": 1, "trainer": "sequential", "calibration": "abc"}\n'
        '{"round": 2, "trainer": "vectorized", "calibration": "abc"}\n'
        '{"round": 3, "trai')  # torn by a kill
    plan = read_plan(tmp_path, upto=1)
    assert plan == Plan({1: "sequential"}, "abc", {"plain": 1.0, "rate": math.inf})
    assert read_plan(tmp_path).rounds == {1: "sequential", 2: "vectorized"}


@pytest.mark.parametrize("plan, needle", [
    ("/nonexistent/run", "is not a run folder"),
    ("EMPTY", "has no plan.jsonl"),
    ("BAD", "plan.jsonl:1 is not a plan line"),
    ("PARALLEL", "round 1 was trained by 'parallel', which cannot train this run here"),
])
def test_a_bad_trainer_plan_is_one_line_exit_2(tmp_path, capsys, plan, needle):
    folder = tmp_path / "plan"
    folder.mkdir()
    if plan == "BAD":
        (folder / PLAN).write_text("not json\n{}\n")
    if plan == "PARALLEL":
        (folder / PLAN).write_text('{"round": 1, "trainer": "parallel"}\n')
    where = plan if plan.startswith("/") else str(folder)
    code = main(["run", "-q", "--out", str(tmp_path / "r"), "--set", f"trainer_plan={where}",
                 "--set", "workers=1", "--dataset", "digits", "--rounds", "1",
                 "--set", "data.num_clients=4", "--set", "clients.per_round=2",
                 "--set", "clients.local_steps=1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and needle in err and len(err.splitlines()) == 1


def test_trainer_plan_needs_auto(capsys):
    assert main(["run", "-q", "--set", "trainer=sequential", "--set",
                 "trainer_plan=/tmp"]) == 2
    assert "needs trainer: auto" in capsys.readouterr().err


def test_cache_info_and_clear(measured, tiny_round, capsys):
    measured(PLAIN_WINS)
    calibrate.costs_for(tiny_round, ["sequential"])
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert "calibration: 1 files" in out and "compiled:" in out and "data:" in out
    assert main(["cache", "clear", "--only", "calibration"]) == 0
    assert not list(calibrate.folder().glob("*.json"))
    assert "calibration: removed" in capsys.readouterr().out


def test_a_calibration_compiles_only_where_the_compile_may_pay(measured, tiny_round,
                                                              monkeypatch):
    import dataclasses

    from protofl.engine.schedule import Job
    from protofl.engine.trainers import Auto

    model = tiny_round.alg.model
    tiny_round = dataclasses.replace(tiny_round, jobs=[Job(0, 2), Job(1, 2)])
    short = Auto(model, rounds=1, calibrate=True)
    assert "compiled" in short.trainers and not short.worth_compiling(tiny_round)
    # the constants' 40 s compile against a million rounds of training: it may pay
    assert Auto(model, rounds=10**6, calibrate=True).worth_compiling(tiny_round)

    asked = []
    monkeypatch.setattr(calibrate, "measure", lambda rc, names, compile=False, compiled=None:
                        asked.append(compile) or (
                            {**PLAIN_WINS, "compile": 1.0} if compile else dict(PLAIN_WINS)))
    cache.clear(("calibration",))
    calibrate.costs_for(tiny_round, ["sequential", "compiled"])
    calibrate.costs_for(tiny_round, ["sequential", "compiled"])  # cached
    table, _ = calibrate.costs_for(tiny_round, ["sequential", "compiled"], compile=True)
    calibrate.costs_for(tiny_round, ["sequential", "compiled"], compile=True)  # cached
    assert asked == [False, True] and table["compile"] == 1.0


def test_a_runs_calibration_compiles_the_graph_its_first_round_uses(tiny_round, monkeypatch):
    """The compiled step is timed on auto's own compiled trainer at the round's clients, so
    the graph compiled then is the one the run trains with: its estimate has no compile left.
    (torch.compile is the identity here: the test is of which graph is made, not of a compile.)"""
    import dataclasses

    from protofl.engine.schedule import Job
    from protofl.engine.trainers import Auto

    monkeypatch.setenv("PROTOFL_CALIBRATE", "1")
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    cache.clear(("calibration",))
    rc = dataclasses.replace(tiny_round, jobs=[Job(0, 2), Job(1, 2), Job(2, 2)])
    auto = Auto(tiny_round.alg.model, rounds=10**6, calibrate=True)
    assert auto.worth_compiling(rc)
    auto.train(rc)
    compiled = auto.trainers["compiled"]
    assert {k.size for k in compiled.graphs} == {3}
    work = auto.work(rc)
    assert compiled.estimate(work) == costs.compiled_seconds(work, frozenset({3}))  # paid


def test_an_unwritable_cache_falls_back_to_the_constants_in_one_line(measured, tiny_round,
                                                                     tmp_path, monkeypatch,
                                                                     caplog):
    measured(PLAIN_WINS)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PROTOFL_CACHE", str(blocker))  # the cache folder cannot be made
    with caplog.at_level(logging.WARNING, logger="protofl"):
        assert calibrate.costs_for(tiny_round, ["sequential"]) == (None, None)
    [line] = [r.getMessage() for r in caplog.records if "calibrating" not in r.getMessage()]
    assert "cannot be cached" in line and "fixed cost constants" in line


def test_a_folder_without_a_plan_resumes_on_the_constants(measured, tmp_path, kill_after,
                                                          monkeypatch):
    monkeypatch.setenv("PROTOFL_CALIBRATE", "0")  # an earlier protofl: the constants
    run_experiment(config_from_dict(_raw()), tmp_path / "full")
    with kill_after(1), pytest.raises(KeyboardInterrupt):
        run_experiment(config_from_dict(_raw()), tmp_path / "killed")
    killed = tmp_path / "killed"
    (killed / PLAN).unlink()  # as a folder written before plans
    m = json.loads((killed / "manifest.json").read_text())
    del m["files"][PLAN]
    (killed / "manifest.json").write_text(json.dumps(m))
    measured(VMAP_WINS)  # calibration on now, and its costs would choose otherwise
    resume_experiment(killed)
    assert read_plan(killed).rounds == {2: "sequential", 3: "sequential"}
    assert read_plan(tmp_path / "full").rounds == {1: "sequential", 2: "sequential",
                                                   3: "sequential"}
    assert _strip(read_metrics(killed)) == _strip(read_metrics(tmp_path / "full"))
