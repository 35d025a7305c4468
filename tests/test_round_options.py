"""What HtFLlib's users rely on, as protofl options: clients that drop out, a decaying local
learning rate, a validation split with early stopping (each checked by hand)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from protofl.api import resume_experiment, run_experiment
from protofl.config import config_from_dict
from protofl.data.synthetic import synthetic_federation
from protofl.engine.experiment import Experiment
from protofl.engine.schedule import drop_out
from protofl.engine.train import LocalSetup, train_client
from protofl.errors import ProtoflError


def config(**over):
    base = {"algorithm": "fedavg", "rounds": 3, "checkpoint_every": 0, "trainer": "sequential",
            "data": {"name": "synthetic", "num_clients": 6},
            "clients": {"per_round": 4, "local_steps": 2},
            "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 0}}
    for section, values in over.items():
        base[section] = {**base.get(section, {}), **values} if isinstance(values, dict) else values
    return config_from_dict(base)


def test_drop_out_by_hand():
    active = np.array([1, 3, 5, 7])
    rng = np.random.default_rng(0)
    kept = drop_out(active, 0.5, rng)
    assert len(kept) == 2 and set(kept) <= set(active) and list(kept) == sorted(kept)
    state = rng.bit_generator.state
    assert drop_out(active, 0.0, rng) is active and rng.bit_generator.state == state  # no draw
    assert len(drop_out(active, 0.3, np.random.default_rng(0))) == 3  # round(1.2) = 1 drops


def test_dropped_clients_neither_train_nor_upload():
    exp = Experiment(config(clients={"dropout": 0.5}))
    for _ in range(3):
        record = exp.step()
        exp.round = record["round"]
        assert len(record["clients"]) == 2 and len(record["dropped"]) == 2
        assert not set(record["clients"]) & set(record["dropped"])


class Recorder:
    """A trainer that notes each round's learning rate and trains sequentially."""

    name = "recorder"

    def __init__(self):
        self.lrs: list[float] = []

    def train(self, rc):
        self.lrs.append(rc.setup.lr)
        return [train_client(rc, j) for j in rc.jobs]


def test_learning_rate_decays_per_round():
    setup = LocalSetup(10, False, lr=0.1, lr_decay=0.5)
    assert setup.at(1).lr == 0.1 and setup.at(3).lr == pytest.approx(0.025)
    assert LocalSetup(10, False).at(7).lr == 0.01  # no decay: the same rate
    rec = Recorder()
    Experiment(config(clients={"lr": 0.1, "lr_decay": 0.5}), trainer=rec).run()
    assert rec.lrs == pytest.approx([0.1, 0.05, 0.025])


def test_compiled_steps_follow_a_decaying_rate(float64, monkeypatch):
    """The compiled trainer bakes the rate into its graphs: each round's rate gets its own
    graph (the last round's dropped), and the steps give the sequential trainer's results.
    torch.compile is replaced by the function itself here (test_vectorized compiles)."""
    from test_vectorized import C, assert_results_equal, federation

    from protofl.algorithms.registry import make_algorithm
    from protofl.engine import compiled, costs
    from protofl.engine.federation import info
    from protofl.engine.schedule import Job
    from protofl.engine.train import RoundContext, SequentialTrainer
    from protofl.models.nets import Mlp

    monkeypatch.setattr(costs, "COMPILED_STEPS", 2)
    monkeypatch.setattr(costs, "LOOPED_STEPS", 2)
    monkeypatch.setattr(compiled.torch, "compile", lambda fn, **kw: fn)
    setup = LocalSetup(4, True, "sgd", 0.2, 0.0, 0.0, seed=1, lr_decay=0.5)
    data = federation()
    torch.manual_seed(0)
    alg = make_algorithm("fedavg", {}, Mlp(5, C, hidden=(8,)), C, info(data))
    state, trainer = alg.init_state(alg.model), compiled.CompiledTrainer()
    jobs = [Job(0, 3), Job(1, 2)]
    for rnd in (1, 2):
        rc = RoundContext(alg, alg.broadcast(state), jobs, data, {}, setup.at(rnd), rnd)
        seq = SequentialTrainer().train(rc)
        assert_results_equal(seq, trainer.train(rc))
        assert {k[2] for k in trainer.graphs} == {setup.at(rnd).lr}
        state, _ = alg.aggregate(state, [r.upload for r in seq], rnd)


def test_hold_out_keeps_each_clients_rows_apart():
    data = synthetic_federation(num_clients=4, seed=1)
    train, val = data.hold_out(0.25, np.random.default_rng(0))
    sizes = data.train_sizes
    assert list(np.diff(val.test_offsets)) == [int(0.25 * n) for n in sizes]
    assert list(train.train_sizes) == [n - int(0.25 * n) for n in sizes]
    for k in range(4):
        x, _ = data.client_train(k)
        kept, held = train.client_train(k)[0], val.client_test(k)[0]
        rows = {tuple(r.tolist()) for r in x}
        assert {tuple(r.tolist()) for r in kept} | {tuple(r.tolist()) for r in held} == rows
        assert len(kept) + len(held) == len(x)
        # the kept rows keep their order
        pos = [next(i for i, r in enumerate(x) if torch.equal(r, q)) for q in kept]
        assert pos == sorted(pos)
    again, _ = data.hold_out(0.25, np.random.default_rng(0))
    assert torch.equal(again.x_train, train.x_train)


def test_early_stopping_after_patience_without_a_better_validation_accuracy(tmp_path):
    # a learning rate too small to move the accuracy: round 1 is the best, and with a
    # patience of 2 the run ends after round 3 of 20
    cfg = config(rounds=20, data={"validation_fraction": 0.3}, clients={"lr": 1e-9},
                 metrics={"early_stop": 2}, checkpoint_every=1)
    summary = run_experiment(cfg, tmp_path / "run")
    assert summary["rounds"] == 3
    assert summary["stopped"].startswith("early stopping") and "round 1" in summary["stopped"]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    accs = [r["validation_accuracy"] for r in rows if "validation_accuracy" in r]
    assert len(accs) == 3 and accs[0] == accs[1] == accs[2]
    # the stop is kept in the checkpoint: resuming goes no further
    again = resume_experiment(tmp_path / "run", rounds=20)
    assert again["rounds"] == 3


def test_early_stopping_needs_a_validation_split():
    with pytest.raises(ProtoflError, match="needs data.validation_fraction"):
        Experiment(config(metrics={"early_stop": 3}))


def test_early_stopping_refuses_a_server_without_validation_rows():
    from types import SimpleNamespace

    from protofl.engine.callbacks import EarlyStop

    cfg = SimpleNamespace(metrics=SimpleNamespace(early_stop=2))
    with pytest.raises(ProtoflError, match="holds no validation rows"):
        EarlyStop().before_run(SimpleNamespace(cfg=cfg, validation=None))


def test_flower_refuses_early_stopping_of_personalised_clients():
    from protofl.flower.server_app import run_on_grid

    cfg = config(algorithm="fedproto", data={"validation_fraction": 0.2},
                 metrics={"early_stop": 2})
    with pytest.raises(ProtoflError, match="stays at its node"):
        run_on_grid(cfg, None)  # refused before the grid is asked anything
