"""Regenerating the evidence changes nothing: docs/reproduction/<claim>.json written again
from the same runs, whichever sources they are read from, gives the same bytes."""

from __future__ import annotations

import json
from pathlib import Path

from fakeruns import make_run

from protofl.cli import main
from protofl.reproduce import write_record
from protofl.reproduce.evidence import merge, write

VARIANTS = ("fedmargin", "fedavg", "fedavg-size-sampled")


def _suite(out: Path, overrides: dict, seeds=range(3)) -> Path:
    """A reproduce folder of the digits claim (fake runs) recorded with ``overrides``."""
    for v in VARIANTS:
        for s in seeds:
            make_run(out / "digits" / "default" / v / f"seed{s}", "fedavg", seed=s, rounds=6,
                     raw={"data": {"seed": s}}, accuracy=0.6 if v == "fedmargin" else 0.5)
    write_record(out, {"digits": {"budget": "paper", "status": "run", "seeds": list(seeds),
                                  "splits": ["default"], "overrides": overrides}})
    write_record(out, {"mnist": {"budget": "paper", "status": "not run here: needs MNIST",
                                 "seeds": [], "splits": ["default"]}})
    return out


def _bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.json"))}


def test_evidence_written_twice_from_the_same_runs_is_the_same_bytes(tmp_path):
    runs = _suite(tmp_path / "runs", {"threads": 1, "data": {"root": "x", "alpha": 0.5}})
    first, again, rewritten = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    write(merge([runs]), first)
    write(merge([runs]), again)  # from the run folders again
    write(merge([first]), rewritten)  # from the evidence files themselves
    assert _bytes(first) == _bytes(again) == _bytes(rewritten)
    assert sorted(_bytes(first)) == ["digits.json", "mnist.json"]
    doc = json.loads((first / "digits.json").read_text())
    # the committed layout: the overrides (sorted) first, the claim's variant order
    assert list(doc) == ["format", "claim", "overrides", "budget", "status", "seeds", "splits",
                         "runs", "amm"]
    assert list(doc["overrides"]) == ["data", "threads"]
    assert list(doc["overrides"]["data"]) == ["alpha", "root"]
    assert list(doc["runs"]["default"]) == ["fedavg", "fedavg-size-sampled", "fedmargin"]
    assert [r["seed"] for r in doc["runs"]["default"]["fedavg"]] == [0, 1, 2]


def test_overrides_given_in_another_order_write_the_same_file(tmp_path):
    one = _suite(tmp_path / "one", {"threads": 1, "data": {"root": "x", "alpha": 0.5}})
    two = _suite(tmp_path / "two", {"data": {"alpha": 0.5, "root": "x"}, "threads": 1})
    write(merge([one]), tmp_path / "e1")
    write(merge([two]), tmp_path / "e2")
    assert _bytes(tmp_path / "e1") == _bytes(tmp_path / "e2")
    # and the two records are the same overrides: their runs are taken together
    assert merge([one, two])["digits"]["seeds"] == [0, 1, 2]


def test_report_regenerates_evidence_and_page_unchanged(tmp_path):
    runs = _suite(tmp_path / "runs", {"threads": 1})
    ev, md = tmp_path / "ev", tmp_path / "r.md"
    assert main(["report", str(runs), "--reproduction", str(md), "--evidence", str(ev)]) == 0
    files, page = _bytes(ev), md.read_bytes()
    assert main(["report", str(ev), "--reproduction", str(md), "--evidence", str(ev),
                 "--overwrite"]) == 0
    assert _bytes(ev) == files and md.read_bytes() == page


def test_the_committed_page_regenerates_from_the_committed_evidence(tmp_path):
    """docs/reproduction.md and docs/reproduction/*.json, regenerated from the evidence
    folder alone (a copy), come out byte for byte as committed (the figure is left out: its
    bytes depend on matplotlib's version)."""
    import shutil

    docs = Path(__file__).resolve().parents[1] / "docs"
    shutil.copytree(docs / "reproduction", tmp_path / "reproduction")
    shutil.copy(docs / "reproduction.md", tmp_path / "reproduction.md")
    ev, md = tmp_path / "reproduction", tmp_path / "reproduction.md"
    assert main(["report", str(ev), "--reproduction", str(md), "--evidence", str(ev),
                 "--overwrite"]) == 0
    assert _bytes(ev) == _bytes(docs / "reproduction")
    assert md.read_bytes() == (docs / "reproduction.md").read_bytes()


def test_the_alternatives_runs_are_kept_in_the_evidence(tmp_path):
    """``suite reproduce --alternatives`` folders: their curves under the key
    ``alternatives`` (references first, then the alternatives in their order), merged with the
    claim's own runs of the same budget and overrides, and read back unchanged."""
    runs = _suite(tmp_path / "runs", {})
    alt = tmp_path / "alt"
    for label in ("score=dplus", "fedavg", "fedmargin"):
        for s in range(3):
            make_run(alt / "digits" / "default" / "alternatives" / label / f"seed{s}", "fedavg",
                     seed=s, rounds=6, raw={"data": {"seed": s}})
    write_record(alt, {"digits": {"budget": "paper", "status": "run", "seeds": [0, 1, 2],
                                  "splits": ["default"], "overrides": {}}})
    merged = merge([runs, alt])["digits"]
    assert sorted(merged["runs"]["default"]) == sorted(VARIANTS)
    assert list(merged["alternatives"]["default"]) == ["fedmargin", "fedavg", "score=dplus"]
    ev = tmp_path / "ev"
    write(merge([runs, alt]), ev)
    doc = json.loads((ev / "digits.json").read_text())
    assert list(doc)[-1] == "alternatives" and "alternatives" not in json.loads(
        (ev / "mnist.json").read_text())
    again = tmp_path / "again"
    write(merge([ev]), again)
    assert _bytes(again) == _bytes(ev)


def test_kept_runs_are_not_run_again(tmp_path):
    """``--kept DIR``: the runs an evidence folder holds at the same budget and overrides are
    left out of the plan; other overrides or another budget keep every run."""
    from protofl.reproduce.plan import reproduce_plan

    curve = {(0, 0): [0.1, 0.2]}
    entry = {"budget": "short", "status": "run", "seeds": [0], "splits": ["default"],
             "overrides": {"threads": 1},
             "runs": {"default": {"fedmargin": curve, "fedavg": dict(curve)}}, "amm": {}}
    write({"digits": entry}, tmp_path / "kept")

    def planned(**kw):
        _, jobs = reproduce_plan("digits", "short", tmp_path / "out", seeds=(0, 1), **kw)
        return {Path(f).relative_to(tmp_path / "out").as_posix() for _, f in jobs}

    every = planned(overrides={"threads": 1})
    assert len(every) == 12  # 6 variants x 2 seeds
    rest = planned(overrides={"threads": 1}, kept=tmp_path / "kept")
    assert every - rest == {"digits/default/fedmargin/seed0", "digits/default/fedavg/seed0"}
    assert planned(kept=tmp_path / "kept") == every  # other overrides: nothing is kept
    _, jobs = reproduce_plan("digits", "paper", tmp_path / "out", seeds=(0,),
                             overrides={"threads": 1}, kept=tmp_path / "kept")
    assert len(jobs) == 6  # another budget


def test_splits_added_later_are_kept_in_the_claims_order(tmp_path):
    """Evidence of one split merged with a later run set of the others lists the splits in
    the claim's order, whichever came first, and writes the same bytes read back."""
    def entry(splits):
        curve = {(0, 0): [0.1, 0.2]}
        return {"budget": "paper", "status": "run", "seeds": [0], "splits": splits,
                "overrides": {},
                "runs": {s: {"fedmargin": curve, "fedavg": dict(curve)} for s in splits}}

    write({"shapes": entry(["a0.1"])}, tmp_path / "old")
    write({"shapes": entry(["a1", "a0.01"])}, tmp_path / "new")
    merged = merge([tmp_path / "old", tmp_path / "new"])
    assert merged["shapes"]["splits"] == ["a0.01", "a0.1", "a1"]
    write(merged, tmp_path / "both")
    write(merge([tmp_path / "both"]), tmp_path / "again")
    assert json.loads((tmp_path / "both" / "shapes.json").read_text())["splits"] == [
        "a0.01", "a0.1", "a1"]
    assert _bytes(tmp_path / "both") == _bytes(tmp_path / "again")
