"""The parallel trainer: the sequential trainer's results from worker processes (bit for bit
with the sequential inner trainer, persistent client states and augmentation included), the
training rows shared rather than copied, the rule ``trainer: auto`` follows, and failures
that reach the parent."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch import nn

from protofl.algorithms.registry import make_algorithm
from protofl.config import config_from_dict
from protofl.data import store
from protofl.data.federated import from_client_lists
from protofl.engine import parallel, trainers
from protofl.engine.parallel import ParallelTrainer, split_jobs
from protofl.engine.schedule import Job
from protofl.engine.train import LocalSetup, RoundContext, SequentialTrainer
from protofl.nested import flatten

C = 3


def federation(sizes=(13, 3, 9, 22, 6), dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, 1, 6, 6, generator=g, dtype=dtype) for n in sizes]
    ys = [torch.arange(n) % C for n in sizes]
    return from_client_lists("toy", C, xs, ys, local_test_fraction=0.0)


def conv_model():
    from protofl.models.nets import ConvNet

    torch.manual_seed(0)
    return ConvNet((1, 6, 6), C, (2,), 3, 4)


def rounds(trainer, alg, data, setup, jobs_per_round):
    """Results of consecutive rounds, client states carried between them."""
    state, client_states, out = alg.init_state(alg.model), {}, []
    for rnd, jobs in enumerate(jobs_per_round, 1):
        res = trainer.train(RoundContext(alg, alg.broadcast(state), jobs, data, client_states,
                                         setup, rnd))
        out.append(res)
        for r in res:
            if r.state:
                client_states[r.client] = r.state
        state, _ = alg.aggregate(state, [r.upload for r in res], rnd)
    return out


def same(a, b, tol=0.0):
    fa, fb = flatten(a), flatten(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        if tol:
            assert torch.allclose(fa[k], fb[k], atol=tol, rtol=0), k
        else:
            assert torch.equal(fa[k], fb[k]), k


JOBS = [[Job(0, 2), Job(2, 1, straggler=True), Job(3, 2), Job(4, 2)],
        [Job(1, 2), Job(3, 2), Job(4, 1, straggler=True)]]


@pytest.mark.parametrize("name", ["fedproin", "moon", "fedproto"])
def test_parallel_equals_sequential_bit_for_bit(name):
    """Augmentation (fedproin), previous models (moon), personal models (fedproto): workers
    train each client exactly as the sequential loop does."""
    data = federation()
    alg = make_algorithm(name, {"flips": True} if name == "fedproin" else {}, conv_model(), C)
    setup = LocalSetup(4, False, "adam", 0.01, seed=3)
    want = rounds(SequentialTrainer(), alg, data, setup, JOBS)
    trainer = ParallelTrainer(2, "sequential")
    try:
        got = rounds(trainer, alg, data, setup, JOBS)
    finally:
        trainer.close()
    for w, g in zip(want, got):
        assert [r.client for r in w] == [r.client for r in g]
        for a, b in zip(w, g):
            same(a.upload, b.upload)
            same(a.state, b.state)
            assert a.loss == b.loss


def test_parallel_with_vectorized_workers_matches_in_float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        data = federation(dtype=torch.float64)
        alg = make_algorithm("fedprox", {"mu": 0.5}, conv_model(), C)
        setup = LocalSetup(4, True, "sgd", 0.1, 0.9, seed=1)
        want = rounds(SequentialTrainer(), alg, data, setup, JOBS)
        trainer = ParallelTrainer(2, "vectorized")
        got = rounds(trainer, alg, data, setup, JOBS)
        trainer.close()
    finally:
        torch.set_default_dtype(old)
    assert [[r.client for r in w] for w in want] == [[r.client for r in g] for g in got]
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            same(a.upload, b.upload, tol=1e-9)


def test_an_experiment_gives_the_sequential_numbers(no_lead):
    """Bit for bit with no lead client (its 3 equal clients on 2 workers would otherwise lead
    with one on both threads: the lead test below)."""
    raw = {"algorithm": "fedmargin", "rounds": 2, "checkpoint_every": 0,
           "data": {"name": "digits", "num_clients": 4},
           "clients": {"per_round": 3, "local_steps": 2},
           "metrics": {"dissimilarity_clients": 2, "train_loss_samples": 50}}
    seq = __import__("protofl.engine.experiment", fromlist=["Experiment"]).Experiment
    want = seq(config_from_dict({**raw, "trainer": "sequential"})).run()
    exp = seq(config_from_dict({**raw, "trainer": "parallel", "workers": 2}))
    exp.trainer.inner = "sequential"
    got = exp.run()
    assert exp.trainer._procs == []  # closed at the end of the run
    drop = ("seconds", "trainer")
    assert {k: v for k, v in got.items() if k not in drop} == {
        k: v for k, v in want.items() if k not in drop}


def test_a_lead_client_trained_on_every_core_gives_the_sequential_results(monkeypatch):
    """Where the plan leads with the longest client (threads made to pay here), it trains in
    the parent on both threads, the others in the workers: the sequential results, each
    upload through the round's hook once, in job order."""
    for key, value in (("thread_gain", 100.0), ("thread_sync", 0.0), ("rate", 1e3)):
        monkeypatch.setitem(parallel.costs.CPU, key, value)
    data = federation()
    alg = make_algorithm("fedprox", {"mu": 0.1}, conv_model(), C)
    setup = LocalSetup(4, False, "sgd", 0.1, 0.9, seed=2)
    hook = lambda rc, client, up: {**up, "params": {  # noqa: E731
        n: v + client for n, v in up["params"].items()}}
    glob = alg.broadcast(alg.init_state(alg.model))
    rc = RoundContext(alg, glob, JOBS[0], data, {}, setup, 1, hook)
    want = SequentialTrainer().train(rc)
    trainer = ParallelTrainer(2, "sequential")
    led = []
    wide = trainer.wide
    monkeypatch.setattr(trainer, "wide", lambda rc: led.append(rc.jobs) or wide(rc))
    try:
        got = trainer.train(rc)
    finally:
        trainer.close()
    assert led == [[Job(3, 2)]]  # client 3: 2 epochs of 22 rows, the most steps
    assert [r.client for r in got] == [0, 2, 3, 4]
    for a, b in zip(want, got):
        same(a.upload, b.upload, tol=1e-6)
        assert a.loss == pytest.approx(b.loss, abs=1e-6)


def test_jobs_are_split_by_local_steps():
    data = federation((10, 40, 20, 30, 5))
    groups = split_jobs([Job(k, 1) for k in range(5)], data, 4, False, 2)
    # steps ceil(n / 4) = 3, 10, 5, 8, 2; largest first to the least loaded: 10 -> A |
    # 8 -> B | 5 -> B (13) | 3 -> A (13) | 2 -> A (a tie goes to the first)
    assert [[j.client for j in g] for g in groups] == [[1, 0, 4], [3, 2]]
    by_steps = split_jobs([Job(0, 3), Job(1, 1), Job(2, 2)], data, 4, True, 2)
    assert [[j.client for j in g] for g in by_steps] == [[0], [2, 1]]


def test_suite_workers_start_no_processes(monkeypatch, tmp_path):
    import protofl.api
    from protofl import executor

    seen = []
    monkeypatch.setattr(protofl.api, "run_experiment", lambda cfg, *a, **k: seen.append(cfg))
    executor.run_one(({"algorithm": "fedavg", "trainer": "auto"}, str(tmp_path), False))
    assert [(c.workers, c.threads) for c in seen] == [(1, 1)]
    assert "parallel" not in trainers.make("auto", conv_model(), "cpu", seen[0].workers).trainers


def test_rows_are_shared_not_pickled(tmp_path):
    """Where workers are spawned, rows in memory go to shared memory and mapped rows are
    opened again from their file: what is pickled stays small whatever the data's size."""
    from multiprocessing.reduction import ForkingPickler

    x = torch.randint(0, 255, (5000, 1, 28, 28), dtype=torch.uint8)
    data = from_client_lists("u8", C, [x[:3000], x[3000:]],
                             [torch.zeros(3000, dtype=torch.long),
                              torch.ones(2000, dtype=torch.long)], local_test_fraction=0.0)
    shared = parallel.SharedTraining.of(data)
    assert data.x_train.is_shared() and shared.x_train is data.x_train
    assert len(ForkingPickler.dumps(shared)) < 10_000  # a handle, not 3.9 MB of pixels
    s = store.Store(tmp_path / "cache", budget=0)
    with store.using(s):
        mapped = from_client_lists("mapped", C, [x[:3000], x[3000:]],
                                   [torch.zeros(3000, dtype=torch.long),
                                    torch.ones(2000, dtype=torch.long)],
                                   local_test_fraction=0.0)
    for arr in s.maps:
        arr.flush()
    desc = parallel.share(mapped.x_train)
    assert isinstance(desc, parallel.Mapped) and len(pickle.dumps(desc)) < 1000
    opened = parallel.opened(desc)
    assert store.mapped_file(opened) == desc.path and torch.equal(opened, mapped.x_train)
    assert np.array_equal(parallel.SharedTraining.of(mapped).open().train_offsets,
                          mapped.train_offsets)


def test_spawned_workers_train_as_forked_ones():
    data = federation()
    alg = make_algorithm("fedavg", {}, conv_model(), C)
    setup = LocalSetup(4, False, "sgd", 0.05, seed=2)
    want = rounds(SequentialTrainer(), alg, data, setup, JOBS[:1])
    trainer = ParallelTrainer(1, "sequential", start="spawn")
    try:
        got = rounds(trainer, alg, data, setup, JOBS[:1])
    finally:
        trainer.close()
    assert [r.client for r in want[0]] == [r.client for r in got[0]]
    for a, b in zip(want[0], got[0]):
        same(a.upload, b.upload)


def test_a_failing_worker_is_reported_and_the_workers_stop():
    from protofl.algorithms.fedavg import FedAvg

    class Broken(FedAvg):
        def client_begin(self, c):
            raise ValueError("client 3 cannot start")

    data = federation()
    alg = Broken({}, conv_model(), C)
    trainer = ParallelTrainer(2, "sequential")
    rc = RoundContext(alg, alg.broadcast(alg.init_state(alg.model)), [Job(3, 1), Job(0, 1)],
                      data, {}, LocalSetup(4, False), 1)
    procs = []
    try:
        trainer._start(rc)
        procs = list(trainer._procs)
        with pytest.raises(RuntimeError, match="client 3 cannot start"):
            trainer.train(rc)
    finally:
        trainer.close()
    assert procs and not any(p.is_alive() for p in procs)


def test_packing_keeps_every_tensor_and_leaf():
    tree = ({"params": {"a.b": torch.arange(6.0).reshape(2, 3).T, "c": torch.tensor(2.5)},
             "mask": torch.tensor([True, False]), "n": torch.tensor(3, dtype=torch.int64),
             "empty": torch.zeros(0, 4)},
            [1, "x", 0.5, None], {})
    packed = parallel.pack(tree)
    assert len(packed.buffers) == 3  # one shared buffer per dtype
    assert all(b.is_shared() for b in packed.buffers.values())
    back = parallel.unpack(pickle.loads(pickle.dumps(packed)))
    assert back[1] == [1, "x", 0.5, None] and back[2] == {}
    same(back[0], tree[0])


def test_threads_default_to_one_for_small_models_and_follow_the_key(monkeypatch):
    """`threads`: 1 for models under a million parameters (more threads only spin), half the
    usable cores for larger ones; a set value is used as given and kept in config.json."""
    from protofl.engine import experiment, spec

    monkeypatch.setattr(spec, "usable_cores", lambda: 8)
    assert spec.auto_threads(sum(p.numel() for p in nn.Linear(10, 10).parameters())) == 1
    assert spec.auto_threads(1_001_000) == 4
    before = torch.get_num_threads()
    for threads, want in ((None, 1), (3, 3)):
        exp = experiment.Experiment(config_from_dict(
            {"threads": threads, "data": {"num_clients": 4}, "clients": {"per_round": 2},
             "rounds": 1}))
        seen = []
        exp.step = lambda seen=seen, exp=exp: (seen.append(torch.get_num_threads()),
                                               type(exp).step(exp))[1]
        exp.run()
        assert seen == [want] and exp.cfg.threads == want  # while it runs
        assert torch.get_num_threads() == before  # and the caller's count afterwards
