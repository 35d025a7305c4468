"""The claims' words follow the numbers: where an interval lies against 0, the generated
claim-by-claim sentences of a hand-made evidence entry, the sensitivity rows of the
reconstruction's alternatives and the references' drift, and the alternatives' jobs."""

import math

import pytest

from protofl.errors import ProtoflError
from protofl.report.claims import DRIFT, paired, placement
from protofl.reproduce import CLAIMS, reproduce_plan
from protofl.reproduce.sensitivity import (
    drift,
    drift_check_text,
    drift_text,
    sensitivity_rows,
    within_drift,
)
from protofl.reproduce.words import claim_words, comparison_sentence, words_markdown


def iv(lo: float, hi: float) -> dict:
    return {"mean": (lo + hi) / 2, "lo": lo, "hi": hi, "n": 5}


@pytest.mark.parametrize(("lo", "hi", "words"), [
    (-0.1, 0.2, "straddles 0"),
    (-0.029, -0.007, "lies below 0"),  # fedproin − no PCL, IID area: not "straddles or touches"
    (0.06, 0.2, "lies above 0"),
    (-0.2, 0.0, "touches 0 from below (fragile: its bound +0.00000 lies within the drift"),
    (math.nan, math.nan, "has no interval (fewer than 2 pairs)"),
])
def test_placement_words(lo, hi, words):
    assert placement(iv(lo, hi)).startswith(words)
    assert ("fragile" in placement(iv(lo, hi))) == ("fragile" in words)


def test_a_bound_within_the_drift_is_fragile():
    assert placement(iv(0.00024, 0.042)) == (
        f"lies above 0 (fragile: its bound +0.00024 lies within the drift ±{DRIFT})")
    assert placement(iv(-0.1, -DRIFT)).startswith("lies below 0 (fragile: its bound -0.00030")
    assert "fragile" not in placement(iv(2 * DRIFT, 0.1))


def _curves(values: list[float]) -> dict:
    """One evaluated round a run, seed s on partition s."""
    return {(s, s): [v] for s, v in enumerate(values)}


# fedmargin − fedavg per seed: 0.10, 0.11, 0.12, 0.13, 0.14 (mean 0.12, sd 0.0158, t 2.776:
# half-width 0.0196); fedavg-size-sampled − fedavg: -0.2 .. +0.2, straddling 0
FEDAVG = [0.40] * 5
FEDMARGIN = [0.50, 0.51, 0.52, 0.53, 0.54]
SIZE_SAMPLED = [0.20, 0.30, 0.40, 0.50, 0.60]


def _entry(**extra) -> dict:
    runs = {"fedavg": _curves(FEDAVG), "fedmargin": _curves(FEDMARGIN),
            "fedavg-size-sampled": _curves(SIZE_SAMPLED)}
    return {"budget": "paper", "status": "run", "seeds": [0, 1, 2, 3, 4],
            "splits": ["default"], "overrides": {}, "runs": {"default": runs}, "amm": {},
            **extra}


def test_a_hand_made_entry_gives_the_exact_sentences():
    claim = CLAIMS["digits"]
    lines = claim_words(claim, _entry())
    assert lines[0] == (
        "- **digits**: **reproduced** by the claim rule (decided by fedmargin − fedavg). Runs "
        "at the paper budget on seeds 0, 1, 2, 3, 4 (5 partitions, one a seed); a run is "
        "evaluated 1 times, so its last 10% is the mean of the last 1 of 1 evaluations.")
    head, size_sampled = claim.comparisons[0], claim.comparisons[1]
    assert comparison_sentence("default", head, paired(_curves(FEDMARGIN), _curves(FEDAVG))) == (
        "fedmargin − fedavg (sampling ∝ size, partial work, weighting; decides): "
        "**reproduced**; last 10% +0.120 [+0.100, +0.140], lies above 0; area +0.120 "
        "[+0.100, +0.140], lies above 0; the last 10% means: fedmargin 0.520 vs fedavg 0.400; "
        "n = 5")
    assert "  - fedmargin − fedavg-size-sampled (partial work, weighting): **inconclusive**; " \
           "last 10% +0.120 [-0.057, +0.297], straddles 0;" in "\n".join(lines)
    assert f"  - {size_sampled.method} − {size_sampled.baseline}" in "\n".join(lines)
    # a comparison whose variants did not run, and the headline pair's finals by seed
    assert ("  - fedmargin-uniform − fedavg (partial work, weighting): not run yet (no paired "
            "runs).") in lines
    assert lines[-1] == (
        "  - fedmargin vs fedavg, the final evaluated round by seed: 0: 0.500 vs 0.400, "
        "1: 0.510 vs 0.400, 2: 0.520 vs 0.400, 3: 0.530 vs 0.400, 4: 0.540 vs 0.400; the "
        "largest step between two consecutive evaluations (of 1): fedmargin 0.000 (seed 4), "
        "fedavg 0.000 (seed 4).")


def test_the_words_follow_the_numbers_when_they_change():
    claim = CLAIMS["digits"]
    # fedmargin now behind FedAvg on every seed: the words turn with the numbers
    entry = _entry()
    entry["runs"]["default"]["fedmargin"] = _curves([0.30, 0.31, 0.32, 0.33, 0.34])
    text = "\n".join(claim_words(claim, entry))
    assert "- **digits**: **not reproduced** by the claim rule" in text
    assert "last 10% -0.080 [-0.100, -0.060], lies below 0" in text
    # a split that did not run keeps a split claim from "reproduced", and says so
    shapes = {**_entry(), "splits": ["a0.1"], "runs": {"a0.1": _entry()["runs"]["default"]}}
    first = claim_words(CLAIMS["shapes"], shapes)[0]
    assert first.startswith("- **shapes**: **inconclusive** by the claim rule (decided by "
                            "fedmargin − fedavg, on a0.01, a0.1, a1; the splits a0.01, a1 did "
                            "not run, and without them it cannot be reproduced)")
    # a headline pair short of a seed says on which seeds it was paired
    uneven = _entry()
    del uneven["runs"]["default"]["fedavg"][(4, 4)]
    assert "on seeds 0, 1, 2, 3, 4 (5 partitions, one a seed; the headline pair on seeds 0, 1, " \
           "2, 3);" in claim_words(claim, uneven)[0]
    short = claim_words(claim, {**_entry(), "budget": "short"})
    assert short == ["- **digits**: run here only at the short budget (seeds 0, 1, 2, 3, 4): "
                     "**reproduced** by the claim rule; a smoke test, never evidence."]
    empty = {**_entry(), "runs": {"default": {}}}
    assert claim_words(claim, empty) == ["- **digits**: **inconclusive** by the claim rule; "
                                         "none of its variants' runs has finished."]
    assert words_markdown({}).startswith("- Not run here (the tables say why and give the "
                                         "command): synthetic, synthetic-main, digits,")


def test_sensitivity_rows_and_the_references_drift():
    claim = CLAIMS["digits"]
    moved = [v + 0.001 for v in FEDMARGIN[:4]] + [FEDMARGIN[4]]  # 1 of 5 repeats bit for bit
    alternatives = {"default": {
        "fedmargin": _curves(moved), "fedavg": _curves(FEDAVG),
        "score=dplus": _curves([0.30, 0.32, 0.31, 0.29, 0.30]),
        "apm_reference=all": _curves(moved)}}
    entry = _entry(alternatives=alternatives)
    rows = sensitivity_rows(claim, entry)
    assert rows[0].startswith("| **digits** | the default fedmargin (run beside the "
                              "alternatives) | – | **reproduced**: last 10% +0.121")
    assert rows[1].startswith("| digits | `score: dplus` (−d⁺ only, Table 3 row 7) | last 10% "
                              "-0.217 [-0.245, -0.189], lies below 0;")
    assert "| **not reproduced**: last 10% -0.096 [-0.110, -0.082], lies below 0;" in rows[1]
    assert rows[2].startswith("| digits | `apm_reference: all` (APM against every class of "
                              "P^{t−1}) | the default's curves on every seed (identical runs) |")
    # before the FedAvg beside them finishes: no reference row, no verdict against it
    alone = {k: v for k, v in alternatives["default"].items() if k != "fedavg"}
    rows = sensitivity_rows(claim, _entry(alternatives={"default": alone}))
    assert len(rows) == 2 and rows[0].endswith(
        "lies below 0; n = 5 | – (no FedAvg has finished beside it yet) |")
    d = drift({"digits": entry})
    # fedmargin: 1 of 5 curves equal; fedavg: 5 of 5
    assert (d["curves"], d["identical"]) == (10, 6)
    assert d["round"] == pytest.approx(0.001) and d["reading"] == pytest.approx(0.001)
    assert "on 6 of 10 curves bit for bit; the others differ by up to 0.0010 in a round" in (
        drift_text({"digits": entry}))
    # the measured 0.001 exceeds the rule's drift: what it would make fragile. fedmargin -
    # fedavg's lower bounds are ~0.10 (none within 0.001); within 0.11, the headline is
    assert drift_check_text({"digits": entry}) == (
        f"Were the rule's drift the 0.0010 measured here, not ±{DRIFT}, the comparisons whose "
        "deciding bound would lie within it: none.")
    assert within_drift({"digits": entry}, 0.11) == ["digits: fedmargin − fedavg"]
    assert drift_check_text({"digits": _entry()}) == ""  # nothing measured


def test_alternatives_jobs(tmp_path):
    record, jobs = reproduce_plan("digits", "paper", tmp_path, seeds=(0,), alternatives=True)
    labels = [j[1].split("/")[-2] for j in jobs]
    assert labels == list(CLAIMS["digits"].alternative_variants())
    assert all("/digits/default/alternatives/" in f for _, f in jobs)
    assert jobs[2][0]["algo"]["score"] == "dplus" and jobs[2][0]["algorithm"] == "fedmargin"
    assert record["digits"]["status"] == "run"
    record, jobs = reproduce_plan(None, "paper", tmp_path, seeds=(0,), alternatives=True)
    assert sorted(record) == ["digits", "shapes", "synthetic-main"]
    with pytest.raises(ProtoflError, match="claim mnist has no alternatives"):
        reproduce_plan("mnist", "paper", tmp_path, alternatives=True)
    # shapes at one split: its references, then the alternatives of the three choices that
    # move fedmargin's last 10% on digits or Synthetic, each on the claim's pretrained encoder
    record, jobs = reproduce_plan("shapes", "paper", tmp_path, seeds=(0,), splits=("a0.1",),
                                  alternatives=True)
    assert [j[1].split("/")[-2] for j in jobs] == [
        "fedmargin", "fedavg", "score=dplus", "combine=product", "clues=lpm", "clues=apm"]
    assert all("/shapes/a0.1/alternatives/" in f and c["data"]["alpha"] == 0.1
               and c["model"]["pretrained"] for c, f in jobs)
    assert jobs[5][0]["algo"]["clues"] == "apm" and record["shapes"]["splits"] == ["a0.1"]
