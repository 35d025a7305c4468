"""The trainer registry, the cost model it reads, and ``trainer: auto``'s per-round choice."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from protofl.algorithms.registry import make_algorithm
from protofl.config import config_from_dict
from protofl.data.federated import from_client_lists
from protofl.engine import costs, trainers
from protofl.engine.federation import info
from protofl.engine.parallel import ParallelTrainer
from protofl.engine.schedule import Job
from protofl.engine.spec import resolve
from protofl.engine.train import LocalSetup, RoundContext, SequentialTrainer
from protofl.errors import ProtoflError
from protofl.models.nets import Mlp, leaf_cnn

C = 3
MLP = Mlp(5, C, hidden=(8, 6))


def test_every_registered_trainer_declares_what_the_choice_reads():
    work = costs.Work((4, 2), 10, 1e5)
    for name in trainers.TRAINERS:
        cls = trainers.trainer_class(name)
        assert cls.name == name and cls.description
        assert cls.unable(MLP, "fp32", torch.device("cpu")) is None
        inst = cls(2) if name == "parallel" else cls()
        assert inst.estimate(work) > 0
    assert list(trainers.describe())[0] == "auto"


def test_an_unknown_trainer_is_one_line():
    with pytest.raises(ProtoflError, match="trainer = 'jax' is not a trainer; one of auto, "
                                           "sequential"):
        trainers.make("jax", MLP)
    data = from_client_lists("toy", C, [torch.randn(4, 5)], [torch.arange(4) % C])
    with pytest.raises(ProtoflError, match="'jax' is not a trainer"):
        resolve(config_from_dict({"algorithm": "fedavg", "trainer": "jax",
                                  "data": {"name": "synthetic"}}), data)


def test_the_cost_model_by_hand():
    # 3 clients of 5, 2 and 2 steps: 3 steps with 1 client, then 2 with all 3
    w = costs.Work((2, 5, 2), 10, 2e5)
    assert w.active() == [(3, 1), (2, 3)]
    k = costs.CPU
    arith = 3 * 2e5 * 10 / k["rate"]
    assert w.arithmetic() == pytest.approx(arith)
    plain = k["plain"] + arith
    assert costs.sequential_seconds(w) == pytest.approx(9 * plain)
    # n plain steps cost n (plain + arith), a vmap step vmap + n (vmap_client + arith): plain
    # steps while n (plain - vmap_client) <= vmap (the arithmetic cancels)
    solo = int(k["vmap"] // (k["plain"] - k["vmap_client"]))
    assert costs.solo_max(costs.Work((9,) * 20, 10, 2e5)) == solo
    assert costs.solo_max(w) == min(3, solo)
    vmap = [(n * plain if n <= solo else k["vmap"] + n * (k["vmap_client"] + arith))
            for n in (1, 3)]
    assert costs.vectorized_seconds(w) == pytest.approx(3 * vmap[0] + 2 * vmap[1])
    # compiled: stack sizes 1 and 3 (bucket(3) = 4, at most the 3 clients), two compiles
    assert [costs.bucket(n, 3) for n in (1, 2, 3)] == [1, 2, 3]
    assert costs.bucket(3, 8) == 4 and costs.bucket(5, 8) == 8
    # windows of at most 8 steps, as even as can be: the least padding
    assert [costs.window(s) for s in (1, 5, 8, 9, 20, 24, 37870)] == [1, 5, 8, 5, 7, 8, 8]
    assert [costs.window(s, 32) for s in (20, 33, 64, 37870)] == [20, 17, 32, 32]
    # a graph's call overhead shared by its window's steps (5 steps: one window of 5)
    step = lambda m, s=5: k["compiled"] / s + m * (k["compiled_client"] + arith)  # noqa: E731
    run = 3 * step(1) + 2 * step(3)
    # a trainer whose windows are 8 steps pads 3 at the tail's width (1 client)
    assert costs.compiled_seconds(w, frozenset({1, 3}), 8) == pytest.approx(
        3 * step(1, 8) + 2 * step(3, 8) + 3 * step(1, 8))
    assert costs.compiled_seconds(w) == pytest.approx(run + 2 * k["compile"])
    assert costs.compiled_seconds(w, frozenset({1})) == pytest.approx(run + k["compile"])
    long = costs.Work((2, 5, 2), 10, 2e5, rounds_left=100)
    assert costs.compiled_seconds(long) == pytest.approx(run + 2 * k["compile"] / 100)
    # a plain step on 2 threads: the arithmetic at 1 + thread_gain the rate, one sync
    assert costs.wide_step(w, 2) == pytest.approx(
        k["plain"] + k["thread_sync"] + arith / (1 + k["thread_gain"]))
    assert costs.wide_step(w, 1) == pytest.approx(plain)


def test_the_longest_client_leads_on_every_core_where_threads_pay():
    """The parallel trainer's plan, by hand: the LEAF CNN's lone long client of a
    heavy-tailed round trains first on both cores, the others spread after it; a balanced
    round, or a model whose step threads do not speed up (the MLP), is spread as before."""
    k = costs.CPU
    flops = costs.forward_flops(leaf_cnn((1, 28, 28), 10), (1, 28, 28))
    w = costs.Work((900, 3500, 355, 340), 10, flops)
    arith = 3 * flops * 10 / k["rate"]
    plain, wide = k["plain"] + arith, k["plain"] + k["thread_sync"] + arith / (
        1 + k["thread_gain"])
    par = ParallelTrainer(2, "sequential")
    # spread: [3500] | [900, 355, 340]; led: 3500 on 2 threads, then [900] | [355, 340]
    assert par.spread_seconds(w) == pytest.approx(3500 * plain + 4 * w.message())
    first, seconds = par.lead(w)
    assert first == 1
    assert seconds == pytest.approx(3500 * wide + 900 * plain + 3 * w.message())
    assert par.estimate(costs.Work(w.steps, 10, flops, rounds_left=10)) == pytest.approx(
        seconds + 2 * k["fork"] / 10)
    assert par.lead(costs.Work((500,) * 4, 10, flops)) == (
        None, pytest.approx(1000 * plain + 4 * w.message()))
    mlp = costs.forward_flops(Mlp(60, 10, hidden=(128, 256)), (60,))
    assert par.lead(costs.Work((3500, 10), 10, mlp))[0] is None
    # a client's messages: 0.6 ms, and 0.75 ms a MB of weights (the LEAF CNN: 3.43 MB)
    cnn = costs.Work.of(leaf_cnn((1, 28, 28), 10), torch.zeros(1, 1, 28, 28), 10, "cpu", [5])
    assert cnn.weights == 4 * sum(p.numel() for p in leaf_cnn((1, 28, 28), 10).parameters())
    assert cnn.message() == pytest.approx(6e-4 + cnn.weights * 7.5e-10)
    assert 3e-3 < cnn.message() < 3.3e-3


def test_jobs_split_longest_first_to_the_least_loaded():
    assert costs.split([10, 3, 8, 5, 2], 2) == [[0, 1, 4], [2, 3]]
    assert costs.split([7], 3) == [[0], [], []]


def test_job_steps():
    data = from_client_lists("toy", C, [torch.randn(25, 5), torch.randn(3, 5)],
                             [torch.arange(25) % C, torch.arange(3) % C],
                             local_test_fraction=0.0)
    assert costs.job_steps(Job(0, 2), data, 10, False) == 6  # 2 epochs of ceil(25/10)
    assert costs.job_steps(Job(1, 4), data, 10, False) == 4
    assert costs.job_steps(Job(0, 7), data, 10, True) == 7


def test_forward_flops_of_an_mlp():
    # 5 -> 8 -> 6 -> 3: 2 (5*8 + 8*6 + 6*3) multiply-adds counted as 2 FLOPs each
    assert costs.forward_flops(MLP, (5,)) == 2 * (5 * 8 + 8 * 6 + 6 * 3)


def test_make_names_and_falls_back():
    cnn = leaf_cnn((1, 28, 28), 10)
    assert isinstance(trainers.make("parallel", MLP, "cpu", 1), ParallelTrainer)
    with pytest.raises(ProtoflError, match="spreads clients over CPU processes"):
        trainers.make("parallel", cnn, "cuda", 2)
    dropout = nn.Sequential(MLP, nn.Dropout(0.1))
    assert isinstance(trainers.make("vectorized", dropout), SequentialTrainer)
    auto = trainers.make("auto", cnn, "cpu", 2)
    assert set(auto.trainers) >= {"sequential", "vectorized", "parallel"}
    assert "parallel" not in trainers.make("auto", cnn, "cpu", 1).trainers
    assert "parallel" not in trainers.make("auto", cnn, "meta", 8).trainers
    assert set(trainers.make("auto", dropout, "cpu", 8).trainers) == {"sequential"}
    # fp16 (a loss scaler): only the sequential trainer
    assert set(trainers.make("auto", MLP, "cpu", 1, "fp16").trainers) == {"sequential"}


def test_auto_refuses_processes_inside_a_daemonic_process(monkeypatch):
    monkeypatch.setattr(trainers, "may_start_processes", lambda: False)
    assert "parallel" not in trainers.make("auto", MLP, "cpu", 8).trainers
    with pytest.raises(ProtoflError, match="daemonic"):
        trainers.make("parallel", MLP, "cpu", 2)


class Fixed:
    """A stand-in trainer with a fixed estimate."""

    def __init__(self, name, seconds):
        self.name, self.seconds, self.seen = name, seconds, []

    def estimate(self, work):
        return self.seconds(work)

    def train(self, rc):
        self.seen.append(rc.round)
        return []


def test_auto_trains_each_round_with_the_cheapest_estimate():
    data = from_client_lists("toy", C, [torch.randn(n, 5) for n in (100, 10, 10)],
                             [torch.arange(n) % C for n in (100, 10, 10)],
                             local_test_fraction=0.0)
    alg = make_algorithm("fedavg", {}, MLP, C, info(data))
    auto = trainers.make("auto", MLP, "cpu", 1, rounds=10)
    # one trainer is cheap when one client holds most steps, the other on balanced rounds
    skew = lambda w: max(w.steps) / sum(w.steps)  # noqa: E731
    auto.trainers = {"a": Fixed("a", lambda w: 1.0), "b": Fixed("b", lambda w: 2 * skew(w))}
    setup = LocalSetup(batch_size=10, by_steps=False)
    for rnd, jobs in ((1, [Job(0, 1), Job(1, 1), Job(2, 1)]), (2, [Job(1, 1), Job(2, 1)])):
        auto.train(RoundContext(alg, {}, jobs, data, {}, setup, rnd))
    # round 1: steps 10, 1, 1 (b: 2 * 10/12 > 1: a); round 2: 1, 1 (b: 2 * 1/2 = 1, a tie:
    # the first registered)
    assert auto.chosen == ["a", "a"]
    auto.trainers["b"] = Fixed("b", lambda w: 1.92 * skew(w))  # 0.96: a (1.0) is within 5%
    auto.train(RoundContext(alg, {}, [Job(1, 1), Job(2, 1)], data, {}, setup, 3))
    assert auto.chosen[-1] == "a"
    auto.trainers["b"] = Fixed("b", lambda w: 1.8 * skew(w))  # 0.90: b
    auto.train(RoundContext(alg, {}, [Job(1, 1), Job(2, 1)], data, {}, setup, 4))
    assert auto.chosen[-1] == "b" and auto.trainers["b"].seen == [4]
    assert trainers.rounds_by_trainer(auto) == {"trainer_rounds": {"a": 3, "b": 1}}


def test_heavy_tailed_rounds_go_where_the_cost_model_says():
    """A lone long client: the compiled step once the run is long enough to pay its
    compile; a balanced round of many clients: vmap; with two cores the long client's
    neighbours train beside it."""
    model = Mlp(60, 10, hidden=(128, 256))
    flops = costs.forward_flops(model, (60,))
    lone = costs.Work((5000,), 10, flops, rounds_left=200)
    auto = trainers.make("auto", model, "cpu", 1, rounds=200)
    if "compiled" in auto.trainers:
        assert trainers.cheapest(auto.trainers, lone) == "compiled"
        short = costs.Work((50,), 10, flops, rounds_left=1)
        assert trainers.cheapest(auto.trainers, short) != "compiled"
    balanced = costs.Work((20,) * 16, 10, flops, rounds_left=1)
    assert trainers.cheapest(auto.trainers, balanced) == "vectorized"
    two = trainers.make("auto", model, "cpu", 2, rounds=200).trainers
    skewed = costs.Work((5000, *(800,) * 9), 10, flops, rounds_left=200)
    assert trainers.cheapest(two, skewed) == "parallel"


def test_auto_gives_the_sequential_results(float64):
    """Whatever it picks, ``auto`` trains a round as the sequential trainer does."""
    from tests.test_vectorized import assert_results_equal

    data = from_client_lists("toy", C, [torch.randn(n, 5) for n in (40, 3, 9, 22)],
                             [torch.arange(n) % C for n in (40, 3, 9, 22)],
                             local_test_fraction=0.0)
    torch.manual_seed(0)
    model = Mlp(5, C, hidden=(8, 6))
    alg = make_algorithm("fedprox", {}, model, C, info(data))
    glob = alg.broadcast(alg.init_state(model))
    setup = LocalSetup(batch_size=4, by_steps=False, momentum=0.9)
    rc = RoundContext(alg, glob, [Job(0, 3), Job(1, 2), Job(2, 1), Job(3, 2)], data, {},
                      setup, 1)
    auto = trainers.Auto(model, "cpu", 1, "fp32", rounds=1, in_process=True)
    assert_results_equal(SequentialTrainer().train(rc), auto.train(rc))
    assert auto.chosen in (["vectorized"], ["sequential"])



def test_the_compiled_trainer_counts_the_graphs_it_holds():
    """Its estimate leaves out the compile of a stack size it already holds a graph of (the
    graphs are keyed by algorithm, size and learning rate)."""
    from protofl.engine.compiled import CompiledTrainer, GraphKey

    w = costs.Work((2, 5, 2), 10, 2e5)
    t = CompiledTrainer()
    assert t.estimate(w) == pytest.approx(costs.compiled_seconds(w))
    t.graphs[GraphKey(0, 1, 0.1)] = None
    assert t.estimate(w) == pytest.approx(costs.compiled_seconds(w, frozenset({1})))
    assert t.estimate(w) < costs.compiled_seconds(w)


NEW_TRAINER = '''
from dataclasses import replace

from protofl.engine.train import SequentialTrainer


class Reversed(SequentialTrainer):
    """The round's clients in reverse order (a trainer from outside protofl's tree)."""

    name = "reversed"
    description = "the round's clients last to first"
    rounds = 0

    def estimate(self, work):
        return 1e-9  # cheaper than any other: auto picks it

    def train(self, rc):
        type(self).rounds += 1
        return super().train(replace(rc, jobs=rc.jobs[::-1]))[::-1]
'''


def test_a_new_trainer_is_one_module_and_one_registry_line(tmp_path, monkeypatch):
    """The door for a trainer: a module anywhere and one line of ``TRAINERS``; then
    ``trainer: NAME`` trains with it, ``protofl trainers`` lists it and ``auto`` weighs it."""
    import protofl

    (tmp_path / "my_trainer.py").write_text(NEW_TRAINER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(trainers.TRAINERS, "reversed", "my_trainer:Reversed")
    tiny = {"rounds": 2, "data": {"name": "digits", "num_clients": 4},
            "clients": {"per_round": 2}}
    cls = trainers.trainer_class("reversed")
    assert trainers.describe()["reversed"] == "the round's clients last to first"
    ref = protofl.run({**tiny, "trainer": "sequential"})
    named = protofl.run({**tiny, "trainer": "reversed"})
    assert cls.rounds == 2
    auto = protofl.run(tiny)
    assert auto.summary["trainer_rounds"] == {"reversed": 2}
    for run in (named, auto):  # the same clients trained on the same broadcast
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(run.state_dict()[k], v)
