"""The comparison rule of ``protofl suite reproduce`` (protofl.report.claims) against
hand-worked numbers, and the pairing of run folders by seed and partition."""

import json
import math

import pytest

from protofl.errors import ProtoflError
from protofl.report.claims import (
    DRIFT,
    claim_verdict,
    curve,
    curves,
    deciding_bound,
    fragile,
    paired,
    readings,
    side,
    t_interval,
    verdict,
    verdict_text,
)


def test_readings_last_tenth_and_area():
    rows = [{"round": t, "accuracy": t / 10} for t in range(1, 11)]  # 0.1 .. 1.0
    assert readings(curve(rows, "accuracy")[1]) == pytest.approx({"last": 1.0, "area": 0.55})
    # 11 evaluated rounds: ceil(1.1) = 2 in the tail, (1.0 + 1.1) / 2
    rows.append({"round": 11, "accuracy": 1.1})
    assert readings(curve(rows, "accuracy")[1])["last"] == pytest.approx(1.05)
    # rows without the metric (not evaluated) do not count
    rows.append({"round": 12})
    assert curve(rows, "accuracy")[0] == list(range(1, 12))
    assert readings(curve(rows, "accuracy")[1])["last"] == pytest.approx(1.05)
    with pytest.raises(ProtoflError):
        curve([{"round": 1}], "miou")


def test_t_interval_by_hand():
    # d = 1..5: mean 3, sd = sqrt(10 / 4) = 1.5811, se = 0.70711, t(0.975, 4) = 2.776445
    iv = t_interval([1, 2, 3, 4, 5])
    half = 2.776445 * math.sqrt(2.5) / math.sqrt(5)  # 1.963243
    assert iv["n"] == 5 and iv["mean"] == pytest.approx(3.0)
    assert iv["lo"] == pytest.approx(3 - half, abs=1e-5)
    assert iv["hi"] == pytest.approx(3 + half, abs=1e-5)
    # two values 0.1, 0.3: mean 0.2, se = 0.1, t(0.975, 1) = 12.7062
    iv = t_interval([0.1, 0.3])
    assert (iv["lo"], iv["hi"]) == pytest.approx((0.2 - 1.270620, 0.2 + 1.270620), abs=1e-5)
    assert math.isnan(t_interval([0.5])["lo"])


def _iv(lo, hi, n=5):
    return {"mean": (lo + hi) / 2, "lo": lo, "hi": hi, "n": n}


def test_verdict_rule():
    assert side(_iv(0.01, 0.2)) == "above" and side(_iv(-0.3, 0.0)) == "below"
    assert side(_iv(-0.1, 0.1)) == "straddles" and side(_iv(0.0, 0.1)) == "straddles"
    assert verdict({"last": _iv(0.01, 0.2), "area": _iv(0.02, 0.1)}) == "reproduced"
    assert verdict({"last": _iv(-0.2, -0.01), "area": _iv(-0.3, 0.0)}) == "not reproduced"
    assert verdict({"last": _iv(0.01, 0.2), "area": _iv(-0.1, 0.1)}) == "inconclusive"
    assert verdict({"last": _iv(0.01, 0.2), "area": _iv(-0.2, -0.1)}) == "inconclusive"
    # fewer than 5 pairs: never decisive
    assert verdict({"last": _iv(0.1, 0.2, 4), "area": _iv(0.1, 0.2, 4)}) == "inconclusive"


def _run(folder, seed, values, data_seed=None):
    folder.mkdir(parents=True)
    data_seed = seed if data_seed is None else data_seed
    (folder / "config.json").write_text(json.dumps({"seed": seed, "data": {"seed": data_seed}}))
    (folder / "metrics.jsonl").write_text(
        "".join(json.dumps({"round": t + 1, "accuracy": v}) + "\n" for t, v in enumerate(values)))
    (folder / "summary.json").write_text(json.dumps({"algorithm": "x", "dataset": "y"}))


def test_paired_by_seed_and_partition(tmp_path):
    # method - baseline per seed, last reading (1 of 5 rounds) and area (mean of 5)
    for s in range(5):
        _run(tmp_path / "m" / f"seed{s}", s, [0.5] * 4 + [0.6 + 0.01 * s])
        _run(tmp_path / "b" / f"seed{s}", s, [0.4] * 4 + [0.5])
    _run(tmp_path / "m" / "seed9", 9, [0.9] * 5)  # no baseline of seed 9: left out
    (tmp_path / "b" / "seed4" / "summary.json").unlink()  # unfinished: left out
    res = paired(curves(tmp_path / "m", "accuracy"), curves(tmp_path / "b", "accuracy"))
    assert res["n"] == 4
    # last: 0.10, 0.11, 0.12, 0.13 -> mean 0.115; area: 0.1 + 0.002 s
    assert res["intervals"]["last"]["mean"] == pytest.approx(0.115)
    assert res["intervals"]["area"]["mean"] == pytest.approx(0.1 + 0.002 * 1.5)
    assert res["means"]["baseline"]["last"] == pytest.approx(0.5)
    assert res["verdict"] == "inconclusive"  # 4 pairs < 5
    _run(tmp_path / "b" / "seed7", 7, [0.4] * 5, data_seed=0)
    _run(tmp_path / "m" / "seed7", 7, [0.4] * 5, data_seed=1)  # another partition: unpaired
    assert paired(curves(tmp_path / "m", "accuracy"),
                  curves(tmp_path / "b", "accuracy"))["n"] == 4


# ---------------------------------------------------------------- fragile, and a claim's verdict
def _res(verdict_word, last, area, n=5):
    return {"verdict": verdict_word, "n": n,
            "intervals": {"last": _iv(*last, n), "area": _iv(*area, n)}}


def test_drift_is_the_measured_cross_machine_drift():
    assert DRIFT == 0.0003


def test_a_deciding_bound_within_the_drift_is_fragile():
    # today's digits row: fedmargin − fedmargin-no-toleration, area [+0.00024, +0.042]
    res = _res("reproduced", (0.029, 0.104), (0.00024, 0.042))
    assert deciding_bound(res) == ("area", "lower", 0.00024) and fragile(res)
    assert verdict_text(res) == (
        "**fragile** (reproduced by the rule, but the area lower bound +0.00024 lies within "
        "the cross-machine drift ±0.0003)")
    assert fragile(_res("reproduced", (0.0003, 0.1), (0.01, 0.2)))  # at the drift: fragile
    settled = _res("reproduced", (0.00031, 0.1), (0.01, 0.2))
    assert not fragile(settled) and verdict_text(settled) == "**reproduced**"
    # not reproduced: the upper bounds decide; the one nearest 0 counts
    assert deciding_bound(_res("not reproduced", (-0.2, -0.0001), (-0.3, -0.1))) == (
        "last", "upper", -0.0001)
    assert fragile(_res("not reproduced", (-0.2, -0.0001), (-0.3, -0.1)))
    assert fragile(_res("not reproduced", (-0.2, 0.0), (-0.3, -0.1)))  # hi = 0: below, fragile
    assert not fragile(_res("not reproduced", (-0.2, -0.001), (-0.3, -0.1)))
    # an inconclusive comparison is never settled, so never "fragile"
    assert deciding_bound(_res("inconclusive", (0.0001, 0.1), (-0.1, 0.1))) is None
    assert not fragile(_res("inconclusive", (0.0001, 0.1), (-0.1, 0.1)))


def test_claim_verdict_is_formed_by_the_deciding_comparisons():
    yes = _res("reproduced", (0.01, 0.1), (0.02, 0.1))
    shaky = _res("reproduced", (0.0001, 0.1), (0.02, 0.1))
    no = _res("not reproduced", (-0.1, -0.01), (-0.1, -0.02))
    no_shaky = _res("not reproduced", (-0.1, -0.0002), (-0.1, -0.02))
    maybe = _res("inconclusive", (-0.1, 0.1), (0.01, 0.1))
    assert claim_verdict([yes]) == {"verdict": "reproduced", "fragile": False}
    assert claim_verdict([yes, shaky]) == {"verdict": "reproduced", "fragile": True}
    assert claim_verdict([yes, maybe]) == {"verdict": "inconclusive", "fragile": False}
    assert claim_verdict([yes, None]) == {"verdict": "inconclusive", "fragile": False}
    assert claim_verdict([]) == {"verdict": "inconclusive", "fragile": False}
    # one settled counter-example refutes "on every dataset / configuration / baseline"
    assert claim_verdict([yes, maybe, no]) == {"verdict": "not reproduced", "fragile": False}
    assert claim_verdict([yes, None, no_shaky]) == {"verdict": "not reproduced",
                                                    "fragile": True}
    assert claim_verdict([no, no_shaky]) == {"verdict": "not reproduced", "fragile": False}


def _record(diffs: dict[str, list[float]]) -> dict:
    """A digits record: per variant, one evaluated round a seed at 0.5 + its offset."""
    runs = {v: {(s, s): [0.5 + d] for s, d in enumerate(ds)} for v, ds in diffs.items()}
    return {"budget": "paper", "status": "run", "seeds": [0, 1, 2, 3, 4],
            "splits": ["default"], "overrides": {}, "runs": {"default": runs}, "amm": {}}


def test_tables_give_the_claims_verdict_and_mark_the_fragile(tmp_path):
    from protofl.reproduce.claims import CLAIMS
    from protofl.reproduce.tables import claim_result, tables_markdown

    # fedmargin − fedavg per seed d = 0, .001, .002, .003, .004 (one round: last = area):
    # mean 0.002, sd = sqrt(10e-6 / 4) = 0.0015811, half = 2.776445 * 0.0015811 / sqrt(5)
    # = 0.0019632, so lo = +0.0000368: reproduced, within the drift: fragile
    zero = [0.0] * 5
    rec = _record({"fedavg": zero, "fedmargin": [0.0, 0.001, 0.002, 0.003, 0.004],
                   "fedmargin-uniform": [-0.1, -0.11, -0.12, -0.13, -0.14]})
    res = paired(rec["runs"]["default"]["fedmargin"], rec["runs"]["default"]["fedavg"])
    assert res["intervals"]["area"]["lo"] == pytest.approx(0.0000368, abs=1e-7)
    assert claim_result(CLAIMS["digits"], rec) == {"verdict": "reproduced", "fragile": True}
    text = tables_markdown({"digits": rec}, only=["digits"])
    assert ("| **digits** | paper | **fragile** (reproduced by the claim rule, resting on a "
            "fragile comparison) | fedmargin − fedavg |") in text
    head = next(ln for ln in text.splitlines() if "fedmargin − fedavg (sampling" in ln)
    assert "; decides the claim)" in head and "lower bound +0.00004 lies within" in head
    assert "to move its bound clear of the drift" in head
    # an isolating comparison that is not reproduced explains; it does not decide
    iso = next(ln for ln in text.splitlines() if "fedmargin-uniform − fedavg" in ln)
    assert "**not reproduced**" in iso and "decides" not in iso
    # the headline clear of the drift: the claim is settled as reproduced
    rec = _record({"fedavg": zero, "fedmargin": [0.01, 0.011, 0.012, 0.013, 0.014],
                   "fedmargin-uniform": [-0.1, -0.11, -0.12, -0.13, -0.14]})
    assert claim_result(CLAIMS["digits"], rec) == {"verdict": "reproduced", "fragile": False}
    assert "| **digits** | paper | **reproduced** | fedmargin − fedavg |" in tables_markdown(
        {"digits": rec}, only=["digits"])
    # a claim over splits: one split not run leaves it inconclusive
    shapes = {**rec, "splits": ["a0.1"], "runs": {"a0.1": rec["runs"]["default"]}}
    assert claim_result(CLAIMS["shapes"], shapes)["verdict"] == "inconclusive"
    assert claim_result(CLAIMS["shapes"], {"status": "not run here: x"}) is None
