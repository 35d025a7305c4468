"""Client-level DP and secure sums in the round loop: the contributions and the estimate by
hand, the clipping bound on a run's real uploads, the noise calibration, the accountant's
per-round composition, reproducibility, epsilon per round, the budget, the one-line refusals,
and sums that reproduce each algorithm's own rule."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from protofl.algorithms.registry import make_algorithm
from protofl.api import resume_experiment, run_experiment
from protofl.config import config_from_dict
from protofl.engine import runfolder
from protofl.engine.experiment import Experiment
from protofl.errors import ProtoflError
from protofl.models.nets import Mlp
from protofl.nested import flatten
from protofl.privacy.accountant import Accountant
from protofl.privacy.contrib import SumForm, SumSettings
from protofl.privacy.noise import effective_multiplier

pytest.importorskip("dp_accounting")

SIGMA = 1.0


def cfg(algorithm: str = "fedavg", privacy: dict | None = None, algo: dict | None = None,
        rounds: int = 3, **top):
    return config_from_dict({
        "algorithm": algorithm, "rounds": rounds, "checkpoint_every": 0, "trainer": "sequential",
        "data": {"name": "synthetic", "num_clients": 6},
        "clients": {"per_round": 3, "local_steps": 2, "batch_size": 20, "sampling": "uniform"},
        "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 0},
        "privacy": privacy or {}, "algo": algo or {}, **top})


def rows(folder):
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


# ---- contributions and the estimate, by hand ----

def fedavg_pair():
    alg = make_algorithm("fedavg", {}, Mlp(2, 2, hidden=(2,)), 2)
    state = alg.init_state(alg.model)
    ups = []
    for n, shift in ((1.0, 1.0), (3.0, -1.0)):
        params = {k: v + shift for k, v in state["params"].items()}
        ups.append({"params": params, "buffers": {}, "num_samples":
                    torch.tensor(n, dtype=torch.float64)})
    return alg, state, ups


def test_exact_sums_reproduce_fedavg_by_hand():
    """n = (1, 3), updates +1 and -1 everywhere: W = W^t + (1 - 3) / 4 = W^t - 0.5."""
    alg, state, ups = fedavg_pair()
    form = SumForm(alg, flatten(alg.broadcast(state)), SumSettings(scale=10.0))
    parts = [form.contribution(u, alg.broadcast(state))[0] for u in ups]
    assert float(parts[1]["weight"]) == pytest.approx(0.3)  # n_k / scale
    est = form.estimate(SumForm.total(parts), alg.broadcast(state))
    for k, v in state["params"].items():
        torch.testing.assert_close(est["params"][k], v - 0.5)
    new, _ = alg.aggregate_private(state, est, 1)
    ref, _ = alg.aggregate(state, ups, 1)
    for k in ref["params"]:
        torch.testing.assert_close(new["params"][k], ref["params"][k])


def test_dp_contribution_is_clipped_and_uniform():
    """DP with FedAvg's unbounded weights: w_k = 1, the update clipped to C, denominator K'."""
    alg, state, ups = fedavg_pair()
    settings = SumSettings(multiplier=1.0, clip=0.5, clients=4)
    form = SumForm(alg, flatten(alg.broadcast(state)), settings)
    c, norm = form.contribution(ups[1], alg.broadcast(state))
    size = sum(v.numel() for v in state["params"].values())
    assert norm == pytest.approx(math.sqrt(size))  # every entry moved by 1
    assert float(c["weight"]) == 1.0
    clipped = math.sqrt(sum(float((v ** 2).sum()) for v in c["delta"].values()))
    assert clipped == pytest.approx(0.5)
    assert form.bounds() == {"delta": 0.5}  # one part: sigma itself
    assert form.multiplier() == pytest.approx(1.0)
    est = form.estimate(SumForm.total([c]), alg.broadcast(state))  # no noise: divide by K'
    for k, v in state["params"].items():
        torch.testing.assert_close(est["params"][k], v + c["delta"][f"params.{k}"].float() / 4)


def test_prototype_sums_by_hand():
    """fedmargin's prototypes: exact sums weigh rows by n_k[c]; DP sums by class fractions
    of clipped rows; a row nobody holds gets count 0 (the previous prototype stays)."""
    alg = make_algorithm("fedmargin", {"scores": "client"}, Mlp(2, 3, hidden=(2,)), 3)
    state = alg.init_state(alg.model)
    b = alg.broadcast(state)
    ups = [{**{k: v for k, v in b.items() if k in ("params", "buffers")},
            "num_samples": torch.tensor(float(sum(n)), dtype=torch.float64),
            "protos": torch.tensor(p), "counts": torch.tensor(n),
            "attention": torch.tensor(1.0, dtype=torch.float64)}
           for p, n in (([[3.0, 4.0], [1.0, 1.0], [0.0, 0.0]], [1.0, 3.0, 0.0]),
                        ([[1.0, 0.0], [3.0, 3.0], [0.0, 0.0]], [1.0, 1.0, 0.0]))]
    exact = SumForm(alg, flatten(b), SumSettings())
    est = exact.estimate(SumForm.total([exact.contribution(u, b)[0] for u in ups]), b)
    torch.testing.assert_close(est["protos"], torch.tensor([[2.0, 2.0], [1.5, 1.5], [0, 0]]))
    torch.testing.assert_close(est["counts"], torch.tensor([2.0, 4.0, 0.0]))
    new, _ = alg.aggregate_private(state, est, 1)
    ref, _ = alg.aggregate(state, ups, 1)
    torch.testing.assert_close(new["protos"], ref["protos"])
    dp = SumForm(alg, flatten(b), SumSettings(multiplier=1e-9, proto_clip=1.0, clients=2))
    c = dp.contribution(ups[0], b)[0]
    torch.testing.assert_close(c["count"]["counts"].float(), torch.tensor([0.25, 0.75, 0.0]))
    # row 0 (norm 5) clipped to norm 1 then weighed 1/4; row 1 (norm 1.41) to 1, weighed 3/4
    torch.testing.assert_close(c["proto"]["protos"].float(), torch.tensor(
        [[0.15, 0.2], [0.75 / math.sqrt(2), 0.75 / math.sqrt(2)], [0.0, 0.0]]))
    # parts: update, the attention sum (bounded by 2), prototype sums, fractions
    assert dp.bounds() == {"delta": 2.0, "weight": 2.0, "count.counts": 1.0,
                           "proto.protos": 1.0}
    assert dp.multiplier() == pytest.approx(effective_multiplier([1e-9] * 4))


def test_noise_on_the_sum_and_client_shares_are_calibrated():
    alg, state, ups = fedavg_pair()
    b = alg.broadcast(state)
    zero = {"delta": {k: torch.zeros(50_000, dtype=torch.float64) for k in ("a",)},
            "weight": torch.tensor(0.0, dtype=torch.float64)}
    server = SumForm(alg, flatten(b), SumSettings(multiplier=1.3, clip=0.5, clients=16))
    out = server.noised(zero, torch.Generator().manual_seed(0))["delta"]["a"]
    assert float(out.std()) == pytest.approx(1.3 * 0.5, rel=0.02)
    clients = SumForm(alg, flatten(b), SumSettings(multiplier=1.3, clip=0.5, clients=16,
                                                   client_noise=True))
    gen = torch.Generator().manual_seed(1)
    total = sum(clients.noised(zero, gen, shares=16)["delta"]["a"] for _ in range(16))
    assert float(total.std()) == pytest.approx(1.3 * 0.5, rel=0.02)
    assert clients.multiplier(received=9) == pytest.approx(1.3 * 0.75)


# ---- the accountant over rounds ----

def test_per_round_epsilon_equals_dp_accountings_composition():
    import dp_accounting as dpa

    for sampling in ("fixed", "poisson"):
        acc = Accountant(1.3, 30, 10, 1e-5, sampling=sampling)
        history = [1.3] * 5 + [0.9] * 2
        rel = (dpa.NeighboringRelation.REPLACE_ONE if sampling == "fixed"
               else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
        ref = dpa.rdp.RdpAccountant(neighboring_relation=rel)
        ref.compose(acc.round_event(1.3), 5)
        ref.compose(acc.round_event(0.9), 2)
        assert acc.epsilon_of(history) == pytest.approx(ref.get_epsilon(1e-5), rel=1e-9)
        assert acc.epsilon(7) < acc.epsilon_of(history)  # less noise in two rounds
    assert Accountant(1.0, 30, 10, 1e-5).epsilon_of([]) == 0.0


# ---- runs ----

class Capture:
    """Keeps every contribution the server computes from raw uploads."""

    def __init__(self, exp):
        self.seen, self.form = [], exp.aggregation.form
        original = self.form.contribution

        def spy(upload, broadcast, state=None, gen=None):
            out = original(upload, broadcast, state, gen)
            self.seen.append(out)
            return out

        self.form.contribution = spy


def test_clipping_bound_holds_on_the_uploads_of_a_run(tmp_path):
    """fedmargin with server-side scores under DP, C small enough that updates are clipped:
    every client's weighted update is within w_max C, its weight within w_max = 2, its
    prototype sums within C_p and its fractions within 1."""
    exp = Experiment(cfg("fedmargin", {"noise_multiplier": SIGMA, "clip": 0.05,
                                       "proto_clip": 0.5}))
    spy = Capture(exp)
    exp.run()
    assert len(spy.seen) == 9 and exp.cfg.clients.sampling == "uniform"
    assert sum(norm > 0.05 for _, norm in spy.seen) >= 5  # clipping was active
    for c, _ in spy.seen:
        w = float(c["weight"])
        assert 0 < w <= 2.0
        update = math.sqrt(sum(float((v ** 2).sum()) for v in c["delta"].values()))
        assert update <= w * 0.05 * (1 + 1e-9)
        assert float(c["proto"]["protos"].norm()) <= 0.5 * (1 + 1e-9)
        assert float(c["count"]["counts"].norm()) <= 1 + 1e-9


def test_dp_run_is_reproducible_and_logs_growing_epsilon(tmp_path):
    """With privacy.reproducible_noise (tests only) a DP run repeats exactly, and says on
    every line that it is not private."""
    repro = {"noise_multiplier": SIGMA, "reproducible_noise": True}
    run_experiment(cfg(privacy=repro), tmp_path / "a")
    run_experiment(cfg(privacy=repro), tmp_path / "b")
    run_experiment(cfg(privacy=repro, seed=1), tmp_path / "c")
    a, b, c = (rows(tmp_path / n) for n in "abc")
    assert a == [{**r, "seconds": a[i]["seconds"]} for i, r in enumerate(b)]
    assert a[-1]["accuracy"] != c[-1]["accuracy"]
    assert all(r["private"] is False for r in a)
    eps = [r["epsilon"] for r in a]
    acc = Accountant(SIGMA, 6, 3, 1e-5)  # fedavg: one part, the update
    assert eps == pytest.approx([acc.epsilon(t) for t in (1, 2, 3)])
    assert eps[0] < eps[1] < eps[2]
    snap = runfolder.load_checkpoint(tmp_path / "a")
    assert snap["privacy"]["multipliers"] == [SIGMA] * 3


def test_budget_stops_the_run_and_resume_keeps_it(tmp_path, caplog):
    acc = Accountant(SIGMA, 6, 3, 1e-5)
    budget = (acc.epsilon(2) + acc.epsilon(3)) / 2  # rounds 1-2 fit, round 3 would not
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, "protofl"):
        summary = run_experiment(cfg(privacy={"noise_multiplier": SIGMA, "budget": budget},
                                     rounds=5), out)
    assert summary["rounds"] == 2 and summary["stopped"] == "privacy budget"
    assert "stopping after round 2" in caplog.text
    assert [r["round"] for r in rows(out)] == [1, 2]
    assert runfolder.load_checkpoint(out)["round"] == 2  # the last round ran is kept
    again = resume_experiment(out, rounds=6)
    assert again["rounds"] == 2 and [r["round"] for r in rows(out)] == [1, 2]
    warn = run_experiment(cfg(privacy={"noise_multiplier": SIGMA, "budget": budget,
                                       "on_budget": "warn"}, rounds=4), tmp_path / "warn")
    assert warn["rounds"] == 4 and warn["epsilon"] > budget and "stopped" not in warn


def test_client_side_noise_runs_in_the_trainers_and_matches_its_accounting(monkeypatch):
    runs = {}
    for trainer in ("sequential", "vectorized", "parallel"):  # parallel: the hook in the parent
        exp = Experiment(cfg("fedmargin", {"noise_multiplier": SIGMA, "noise": "client",
                                           "reproducible_noise": True},
                             {"scores": "client"}, trainer=trainer, workers=2))
        runs[trainer] = exp
        exp.run()
    a = flatten(runs["sequential"].state)
    for other in ("vectorized", "parallel"):
        b = flatten(runs[other].state)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    with monkeypatch.context() as m:  # the same run with the clients' noise left out
        m.setattr(SumForm, "noised", lambda self, tree, gen, shares=1: tree)
        quiet = Experiment(cfg("fedmargin", {"noise_multiplier": SIGMA, "noise": "client",
                                             "reproducible_noise": True},
                               {"scores": "client"}, trainer="sequential"))
        quiet.run()
    q = flatten(quiet.state)
    assert any(not torch.equal(a[k], q[k]) for k in a)  # the trainers did add the noise
    exp = runs["sequential"]
    sigma = effective_multiplier([SIGMA] * 4)  # update, attention sum, prototypes, fractions
    assert exp.aggregation.epsilon() == pytest.approx(Accountant(sigma, 6, 3, 1e-5).epsilon(3))
    assert "amm" not in exp.last  # contributions hold no one client's prototypes


@pytest.mark.parametrize("algorithm, algo", [
    ("fedavg", {}), ("fedprox", {}), ("moon", {}), ("fedproto", {}),
    ("fedmargin", {"scores": "client"}), ("fedmargin", {"scores": "client", "weights": "fair"}),
])
def test_secure_sums_reproduce_each_rule(algorithm, algo):
    """privacy.secagg in process: the clients' contributions summed give the plain run."""
    plain, sums = (Experiment(cfg(algorithm, p, algo, rounds=2))
                   for p in ({}, {"secagg": True}))
    plain.run()
    sums.run()
    a, b = flatten(plain.state), flatten(sums.state)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_secure_sums_reproduce_fedproin_for_a_round():
    """(From round 2 on, fedproin's prototype-contrastive loss starts at ||P^g - P|| = 0, whose
    gradient direction follows float rounding, so only one round compares.)"""
    plain, sums = (Experiment(cfg("fedproin", p, rounds=1)) for p in ({}, {"secagg": True}))
    plain.run()
    sums.run()
    for k, v in flatten(plain.state).items():
        torch.testing.assert_close(v, flatten(sums.state)[k], rtol=1e-5, atol=1e-6)


def test_fedmargin_scored_by_clients_equals_scored_by_the_server():
    server, client = (Experiment(cfg("fedmargin", algo=a, rounds=2))
                      for a in ({}, {"scores": "client"}))
    rs, rc = server.run(), client.run()
    for k, v in flatten(server.state).items():
        torch.testing.assert_close(v, flatten(client.state)[k], rtol=0, atol=0)
    assert rs["accuracy"] == rc["accuracy"]


@pytest.mark.parametrize("algorithm, privacy, extra, needle", [
    ("fedatt", {"noise_multiplier": 1.0}, {}, "fedatt cannot be trained with client-level DP"),
    ("fedplvm", {"noise_multiplier": 1.0}, {}, "clusters every client's local prototypes"),
    ("central", {"noise_multiplier": 1.0}, {}, "pooled data"),
    ("fedavg", {"noise_multiplier": 1.0}, {"clients": {"per_round": 3, "sampling": "weighted"}},
     "clients.sampling = weighted"),
    ("fedavg", {"noise_multiplier": 1.0, "accountant": "pld"}, {}, "pld supports only poisson"),
    ("fedavg", {"budget": 3.0}, {}, "privacy.budget needs privacy.noise_multiplier"),
    ("fedavg", {"noise_multiplier": 1.0, "budget": 0.01}, {}, "below the epsilon of one round"),
    ("fedmargin", {"noise_multiplier": 1.0, "noise": "client"}, {}, "algo.scores: client"),
    ("fedtgp", {"secagg": True}, {}, "prototype generator"),
    ("fedavg", {"secagg": True}, {"clients": {"per_round": 1}}, "per_round >= 2"),
    ("fedavg", {"secagg": True}, {"metrics": {"ffd_reference": "runs/c"}}, "only sums"),
    ("fedavg", {"noise_multiplier": 1.0, "noise": "client"},
     {"metrics": {"ffd_reference": "runs/c"}}, "only sums"),
])
def test_privacy_settings_not_covered_are_one_line(algorithm, privacy, extra, needle):
    raw = cfg(algorithm, privacy).to_dict()
    for k, v in extra.items():
        raw[k].update(v)
    with pytest.raises(ProtoflError, match=needle) as e:
        Experiment(config_from_dict(raw))
    assert "\n" not in str(e.value)


def test_fedtgp_under_dp_uses_its_documented_fallback(caplog):
    with caplog.at_level(logging.WARNING, "protofl"):
        exp = Experiment(cfg("fedtgp", {"noise_multiplier": SIGMA, "proto_clip": 5.0},
                             rounds=1))
        exp.run()
    assert "noised mean prototype of each class" in caplog.text
    assert exp.last["epsilon"] > 0


# ---- the noise cannot be regenerated from what a run publishes ----

def strip_noise_attack(folder, noise: str) -> tuple[dict, dict]:
    """What an attacker holding ``config.json`` and the released round-1 model makes of it
    (fedavg, DP): the noise regenerated from the published seed (as the seeded code draws
    it), subtracted from the released weights. Returns (recovered, released) params."""
    from protofl.seeding import CLIENT_NOISE, NOISE, torch_gen

    raw = runfolder.load_config_json(folder)
    seed, k = raw["seed"], raw["clients"]["per_round"]
    exp = Experiment(config_from_dict({**raw, "rounds": 1}))
    flat = flatten(exp.state)
    zeros = {"delta": {n: torch.zeros_like(flat[n], dtype=torch.float64)
                       for n in exp.aggregation.form.weights}}
    clients = rows(folder)[0]["clients"]
    if noise == "server":
        gens = [(torch_gen(seed, NOISE, 1), 1)]
    else:
        gens = [(torch_gen(seed, CLIENT_NOISE, 1, c), k) for c in clients]
    total = {n: torch.zeros_like(v) for n, v in zeros["delta"].items()}
    for gen, shares in gens:
        for n, v in exp.aggregation.form.noised(zeros, gen, shares)["delta"].items():
            total[n] += v
    released = flatten(runfolder.load_checkpoint(folder)["state"])
    return {n: released[n].double() - total[n] / k for n in total}, released


@pytest.mark.parametrize("noise", ["server", "client"])
def test_dp_noise_cannot_be_regenerated_from_the_published_seed(tmp_path, monkeypatch, noise):
    """The seeded noise (privacy.reproducible_noise) is stripped exactly from the released
    model by regenerating it from config.json's seed; the default noise (the OS's CSPRNG)
    is not: what is left is still about as far from the exact mean as the noise is."""
    original = SumForm.noised
    for name, extra in (("seeded", {"reproducible_noise": True}), ("secret", {})):
        exact = []  # what the noise is added to: the sum (server) or each contribution

        def spy(self, tree, gen, shares=1, exact=exact):
            exact.append(tree["delta"])
            return original(self, tree, gen, shares)

        out = tmp_path / name
        privacy = {"noise_multiplier": SIGMA, "noise": noise, **extra}
        with monkeypatch.context() as m:
            m.setattr(SumForm, "noised", spy)
            run_experiment(cfg(privacy=privacy, rounds=1, checkpoint_every=1), out)
        recovered, _ = strip_noise_attack(out, noise)
        base = flatten(Experiment(cfg(privacy=privacy, rounds=1)).state)
        assert len(exact) == (1 if noise == "server" else 3)
        for n, got in recovered.items():
            want = base[n].double() + sum(d[n] for d in exact) / 3  # the un-noised mean
            gap = float((got - want).abs().max())
            if name == "seeded":
                assert gap < 1e-5, n  # the attack works: the noise protects nothing
            else:
                assert gap > 0.05, n  # std sigma C / K' = 1/3 per entry is still there
        assert rows(out)[0].get("private", True) is (name == "secret")


def test_os_entropy_noise_is_standard_normal_and_never_repeats():
    """The CSPRNG's Gaussian (Box-Muller over os.urandom) against N(0, 1) by a KS test; two
    draws differ; the seeded source repeats (it is torch.randn with the keyed generator)."""
    from scipy import stats

    from protofl.privacy.noise import OsEntropy, gaussian, noise_source
    from protofl.seeding import torch_gen

    a = gaussian((401, 50), torch.float64, OsEntropy())
    assert a.shape == (401, 50) and a.dtype == torch.float64
    assert stats.kstest(a.flatten().numpy(), "norm").pvalue > 1e-4
    assert not torch.equal(a, gaussian((401, 50), torch.float64, OsEntropy()))
    assert isinstance(noise_source(False, 0, 6, 1), OsEntropy)
    seeded = gaussian((7,), torch.float32, noise_source(True, 3, 6, 1))
    assert torch.equal(seeded, torch.randn(7, generator=torch_gen(3, 6, 1)))


def test_report_says_not_private_for_seeded_noise(tmp_path, capsys):
    from protofl.cli import main

    run_experiment(cfg(privacy={"noise_multiplier": SIGMA, "reproducible_noise": True},
                       rounds=1), tmp_path / "runs" / "seeded")
    run_experiment(cfg(privacy={"noise_multiplier": SIGMA}, rounds=1), tmp_path / "runs" / "dp")
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "r.html")]) == 0
    said = capsys.readouterr().out
    assert "NOT PRIVATE: 1 run(s)" in said and "seeded" in said and "runs/dp" not in said
    assert "<h1>NOT PRIVATE" in (tmp_path / "r.html").read_text()
    assert main(["report", str(tmp_path / "runs" / "dp"), "--out", str(tmp_path / "d.html")]) == 0
    assert "NOT PRIVATE" not in capsys.readouterr().out
