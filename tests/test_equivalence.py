"""The equivalence verdict, the pre-registered sample sizes and a claim's learning-rate
search, against hand-worked numbers and independent computations."""

import numpy as np
import pytest

from protofl.report.claims import (
    DELTA,
    claim_verdict,
    deciding_bound,
    equivalent,
    fragile,
    paired,
    t_interval,
    verdict,
    verdict_text,
)
from protofl.reproduce import prereg
from protofl.reproduce.claims import CLAIMS
from protofl.reproduce.search import chosen_rates, search_jobs


def _runs(diffs):
    """``(method, baseline)`` curves of one evaluated round a seed: method − baseline = d."""
    return ({(s, s): [0.5 + d] for s, d in enumerate(diffs)},
            {(s, s): [0.5] for s in range(len(diffs))})


# d = .01, -.01, 0, .02, -.02: mean 0, sd = sqrt(10e-4 / 4) = 0.0158114, se = 0.0070711;
# 90%: t(0.95, 4) = 2.131847, half 0.0150747; 95%: t(0.975, 4) = 2.776445, half 0.0196324
D = [0.01, -0.01, 0.0, 0.02, -0.02]


def test_the_90_percent_interval_by_hand():
    iv = t_interval(D, 0.90)
    assert (iv["lo"], iv["hi"]) == pytest.approx((-0.0150747, 0.0150747), abs=1e-6)


def test_equivalent_within_delta_is_not_reproduced():
    res = paired(*_runs(D), delta=0.02)
    assert res["intervals"]["last"]["hi"] == pytest.approx(0.0196324, abs=1e-6)  # straddles 0
    assert res["verdict"] == "not reproduced"
    assert deciding_bound(res) == ("last", "lower", pytest.approx(-0.0150747, abs=1e-6))
    assert not fragile(res)
    assert verdict_text(res) == "**not reproduced (equivalent within ±0.02)**"
    # a margin the 90% bound crosses: undecided
    assert paired(*_runs(D), delta=0.015)["verdict"] == "inconclusive"
    # no margin: the rule as before
    assert paired(*_runs(D))["verdict"] == "inconclusive"
    # a claim whose deciding comparison is equivalent is not reproduced
    assert claim_verdict([res]) == {"verdict": "not reproduced", "fragile": False}


def test_a_bound_within_the_drift_of_the_margin_is_fragile():
    res = paired(*_runs(D), delta=0.0151)  # 0.0151 − 0.0150747 <= 0.0003
    assert res["verdict"] == "not reproduced" and fragile(res)
    assert "lies within the cross-machine drift ±0.0003 of ±0.0151" in verdict_text(res)


def test_equivalence_needs_both_readings_and_never_overrides_a_decided_one():
    inside, wide = {"lo": -0.01, "hi": 0.01, "n": 5}, {"lo": -0.01, "hi": 0.03, "n": 5}
    assert equivalent({"last": inside, "area": inside}, 0.02)
    assert not equivalent({"last": inside, "area": wide}, 0.02)
    assert not equivalent({"last": {"lo": -0.02, "hi": 0.0, "n": 5}}, 0.02)  # strict
    above = {"last": {"lo": 0.001, "hi": 0.01, "n": 5}, "area": {"lo": 0.002, "hi": 0.01, "n": 5}}
    assert verdict(above, narrow=above, delta=0.02) == "reproduced"
    straddle = {"last": {"lo": -0.001, "hi": 0.01, "n": 5}, "area": above["area"]}
    assert verdict(straddle, narrow=straddle, delta=0.02) == "not reproduced"
    few = {r: {**iv, "n": 4} for r, iv in straddle.items()}
    assert verdict(few, narrow=few, delta=0.02) == "inconclusive"


def test_a_verdict_reads_only_the_pre_registered_seeds():
    # seeds 0-4 clearly above 0, seeds 5, 6 far below: pre-registered n = 5 reads 0-4 only
    method, base = _runs([0.10, 0.11, 0.12, 0.13, 0.14, -0.5, -0.6])
    res = paired(method, base, delta=0.02, seeds=[0, 1, 2, 3, 4])
    assert res["n"] == 5 and res["verdict"] == "reproduced" and res["pending"] is None
    # n = 7 pre-registered, 5 ran: no verdict yet, however good the 5 look
    early = {k: v for k, v in method.items() if k[0] < 5}
    res = paired(early, base, delta=0.02, seeds=list(range(7)))
    assert res["verdict"] == "inconclusive" and (res["pending"], res["planned"]) == (5, 7)
    # and once the 7 ran, the 7 decide
    assert paired(method, base, delta=0.02, seeds=list(range(7)))["verdict"] == "inconclusive"


def test_planned_n_against_a_simulation():
    # P(t(0.95, n-1) * S / sqrt(n) <= delta) by simulation: >= 80% at n, < 80% at n - 1
    rng = np.random.default_rng(0)
    from scipy import stats

    def chance(n, sd, delta):
        s = rng.normal(0, sd, (20000, n)).std(axis=1, ddof=1)
        return float(np.mean(stats.t.ppf(0.95, n - 1) * s / np.sqrt(n) <= delta))

    for sd in (0.0434, 0.074):
        n = prereg.planned_n(sd, 0.02)
        assert chance(n, sd, 0.02) >= 0.79 and chance(n - 1, sd, 0.02) < 0.81
    assert prereg.planned_n(0.001, 0.02) == 5  # never below the rule's 5 seeds


def test_the_pre_registration_is_what_the_pilots_give():
    from protofl.reproduce.evidence import merge
    from protofl.reproduce.preregistration import PREREGISTERED

    assert PREREGISTERED, "the pre-registration is committed"
    records = merge([__import__("pathlib").Path("docs/reproduction")])
    date, commit = PREREGISTERED[0]["date"], PREREGISTERED[0]["commit"]
    assert list(PREREGISTERED) == prereg.plan_entries(records, date, commit)
    assert all(p["delta"] == DELTA[CLAIMS[p["claim"]].metric] for p in PREREGISTERED)


def test_the_search_runs_every_variant_at_every_rate_and_chooses_the_best():
    claim = CLAIMS["fedproin-digits-fair"]
    s = claim.search
    jobs = search_jobs(claim, claim.protocol, __import__("pathlib").Path("out"), ["iid"])
    assert len(jobs) == len(claim.variants) * len(s.grid) * len(s.seeds)
    raw, folder = jobs[0]
    assert raw["data"]["validation_fraction"] == 0.2 and raw["clients"]["lr"] == s.grid[0]
    assert raw["clients"]["optimizer"] == "adam" and folder.endswith(
        f"iid/search/fedproin@{s.grid[0]:g}/seed{s.seeds[0]}")
    # validation curves: fedproin best at 1e-3 (its last 10%: the last value of 2); fedavg
    # ties 3e-4 and 3e-3: the smaller; every other variant best at 1e-4
    score = {("fedproin", 1e-3): 0.9, ("fedavg", 3e-4): 0.8, ("fedavg", 3e-3): 0.8}
    curves = {"iid": {s.label(v, lr): {(seed, seed): [0.1, score.get((v, lr), 0.5 - lr)]
                                       for seed in s.seeds}
                      for v in claim.variants for lr in s.grid}}
    rates = chosen_rates(claim, curves, ["iid"])
    assert rates["iid"]["fedproin"] == 1e-3 and rates["iid"]["fedavg"] == 3e-4
    assert rates["iid"]["moon"] == 1e-4
    del curves["iid"][s.label("moon", 3e-3)]
    assert chosen_rates(claim, curves, ["iid"]) is None  # a search run missing: no choice


def test_the_search_is_the_pre_registered_one():
    from protofl.reproduce.preregistration import SEARCH

    s = CLAIMS[SEARCH["claim"]].search
    assert (s.grid, s.optimizer, s.validation_fraction, s.seeds) == (
        SEARCH["grid"], SEARCH["optimizer"], SEARCH["validation_fraction"], SEARCH["seeds"])


def test_the_tables_read_synthetic_main_at_its_pre_registered_n():
    from protofl.reproduce.prereg import planned
    from protofl.reproduce.tables import claim_result, tables_markdown

    claim, n = CLAIMS["synthetic-main"], planned("synthetic-main", "default", "fedmargin",
                                                 "fedavg")["n"]

    def record(diffs):
        runs = {"fedavg": {(s, s): [0.5] for s in range(len(diffs))},
                "fedmargin": {(s, s): [0.5 + d] for s, d in enumerate(diffs)}}
        return {"budget": "paper", "status": "run", "seeds": list(range(len(diffs))),
                "splits": ["default"], "overrides": {}, "runs": {"default": runs}}

    small = [0.001 * (s % 5 - 2) for s in range(n + 3)]  # mean 0, 90% half-width < 0.002
    assert claim_result(claim, record(small[:5]))["verdict"] == "inconclusive"  # 5 of n
    text = tables_markdown({"synthetic-main": record(small[:5])}, only=["synthetic-main"])
    assert f"the pre-registered {n} seeds (5 ran" in text and f"n = {n} (seeds 0-{n - 1})" in text
    assert claim_result(claim, record(small[:n]))["verdict"] == "not reproduced"  # equivalent
    # seeds past n do not count: three huge gains after the n change nothing
    assert claim_result(claim, record(small[:n] + [0.9, 0.9, 0.9]))["verdict"] == (
        "not reproduced")


def test_a_search_the_evidence_holds_is_not_run_again(tmp_path):
    from protofl.reproduce import reproduce_plan
    from protofl.reproduce.evidence import write

    claim = CLAIMS["fedproin-digits-fair"]
    s = claim.search
    record, jobs = reproduce_plan(claim.name, "short", tmp_path / "out")
    assert record[claim.name]["search"] == "pending"  # the claim's runs wait for the search
    assert len(jobs) == 2 * len(claim.variants) * len(s.grid)
    # the evidence holds the whole search (fedavg best at 3e-3 on iid): only the claim's runs
    search = {split: {s.label(v, lr): {(100, 100): [lr if v == "fedavg" else 0.5 - lr]}
                      for v in claim.variants for lr in s.grid} for split in claim.splits}
    write({claim.name: {"budget": "short", "status": "run", "seeds": [0, 1],
                        "splits": list(claim.splits), "overrides": {}, "runs": {}, "amm": {},
                        "search": search}}, tmp_path / "ev")
    record, jobs = reproduce_plan(claim.name, "short", tmp_path / "out",
                                  kept=tmp_path / "ev")
    assert "search" not in record[claim.name] and len(jobs) == 2 * 2 * len(claim.variants)
    fedavg = [raw for raw, folder in jobs if "/iid/fedavg/" in folder]
    assert {raw["clients"]["lr"] for raw in fedavg} == {3e-3}
    assert all(raw["data"].get("validation_fraction", 0) == 0 for raw, _ in jobs)
