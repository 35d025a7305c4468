import json

import numpy as np
import pytest
from fakeruns import make_run
from scipy import stats as sps

from protofl.cli import main
from protofl.report.compare import compare, load_runs, make_tables, natural_key, table4


def _one_line_exit_2(args, capsys, needle):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


# ---- readable labels and captions ----

ABLATION = {  # resolved-config style: every run states every option
    "fedavg-weights": {"algo": {"weights": "fedavg", "clues": "both"},
                       "clients": {"tolerate_partial": False, "sampling": "weighted"}},
    "iid": {"algo": {"weights": "fedavg", "clues": "both"},
            "clients": {"tolerate_partial": False, "sampling": "uniform"}},
    "lpm": {"algo": {"weights": "attention", "clues": "lpm"},
            "clients": {"tolerate_partial": True, "sampling": "weighted"}},
    "full": {"algo": {"weights": "attention", "clues": "both"},
             "clients": {"tolerate_partial": True, "sampling": "weighted"}},
    "full-again": {"algo": {"weights": "attention", "clues": "both"},
                   "clients": {"tolerate_partial": True, "sampling": "weighted"}},
}


def test_ablation_rows_get_words_and_explicit_equal_values_pool(tmp_path):
    for name, raw in ABLATION.items():
        for seed in (0, 1):
            make_run(tmp_path / name / f"s{seed}", "fedmargin", seed, raw=raw)
    (t,) = make_tables(load_runs(sorted(tmp_path.glob("*/s*"))))
    labels = {row.label: len(row.runs) for row in t.rows}
    assert labels == {
        "fedmargin, FedAvg weights, stragglers dropped": 2,
        "fedmargin, FedAvg weights, uniform (i.i.d.) sampling, stragglers dropped": 2,
        "fedmargin, LPM only": 2,
        "fedmargin": 4,  # "full" and "full-again" state the same values: one row
    }
    assert t.baselines["fedmargin"] == ("LPM and APM, margin attention weights, weighted "
                                        "sampling, partial work tolerated")
    assert "6 clients, 3 per round, 5 rounds of 1 local epoch(s)" in t.caption
    assert "seeds 0, 1" in t.caption


def test_each_algorithms_own_defaults_never_label_it(tmp_path):
    # resolved configs differ between algorithms (toleration, options), not within one
    make_run(tmp_path / "a", "fedavg", raw={"clients": {"tolerate_partial": False}})
    make_run(tmp_path / "b", "fedprox", raw={"clients": {"tolerate_partial": True},
                                             "algo": {"mu": 0.01}})
    make_run(tmp_path / "c", "fedmargin", raw={"clients": {"tolerate_partial": True},
                                               "algo": {"weights": "attention"}})
    (t,) = make_tables(load_runs([tmp_path / n for n in "abc"]))
    assert [row.label for row in t.rows] == ["fedavg", "fedprox", "fedmargin"]
    assert t.baselines == {}


def test_a_setting_that_varies_across_the_table_is_named(tmp_path):
    make_run(tmp_path / "a", "fedavg", rounds=5)
    make_run(tmp_path / "b", "fedmargin", rounds=5, raw={"clients": {"per_round": 4}})
    (t,) = make_tables(load_runs([tmp_path / "a", tmp_path / "b"]))
    assert [row.label for row in t.rows] == ["fedavg, per round=3", "fedmargin, per round=4"]
    assert "3/4 (differs between rows) per round" in t.caption


def test_paper_defaults_that_cannot_matter_never_label_a_row(tmp_path):
    """Local epochs under local_steps and momentum under Adam are inert: the paper defaults
    that fill them (fedprox: E = 20, moon: momentum 0.9, E = 10) do not label a row; counted
    in epochs, fedprox's E = 20 does."""
    steps = {"clients": {"local_steps": 10, "optimizer": "adam", "lr": 0.001,
                         "batch_size": 32, "weight_decay": 0.0}}
    for name in ("fedavg", "fedprox", "moon"):
        make_run(tmp_path / name, name, raw=steps, paper_defaults=True)
    make_run(tmp_path / "fedproin", "fedproin", raw={"clients": {"local_steps": 10,
                                                                 "batch_size": 32}},
             paper_defaults=True)
    (t,) = make_tables(load_runs([tmp_path / n for n in ("fedavg", "fedprox", "moon",
                                                          "fedproin")]))
    assert [row.label for row in t.rows] == ["fedavg, lr=0.001", "fedprox, lr=0.001",
                                             "moon, lr=0.001", "fedproin, lr=0.0001"]
    for name in ("fedavg", "fedprox"):
        make_run(tmp_path / "epochs" / name, name, paper_defaults=True)
    (t,) = make_tables(load_runs([tmp_path / "epochs" / n for n in ("fedavg", "fedprox")]))
    assert [row.label for row in t.rows] == ["fedavg, local epochs=1",
                                             "fedprox, local epochs=20"]


def test_markdown_names_the_seconds_column_and_explains_columns(tmp_path):
    make_run(tmp_path / "a")
    text = compare([tmp_path / "a"])
    assert "| method | seeds | accuracy |" in text and "wall-clock s |" in text
    assert "| seconds |" not in text
    assert "wall-clock s: seconds the whole run spent in its rounds" in text


# ---- Table 4 ----

def test_table4_amm_ffd_and_pearson_against_independent_figures(tmp_path):
    folders = []
    for alg, acc in (("fedavg", 0.5), ("fedprox", 0.6), ("fedmargin", 0.8)):
        for seed in (0, 1, 2):
            folders.append(make_run(tmp_path / alg / f"s{seed}", alg, seed, mmd=True,
                                    accuracy=acc))
    runs = load_runs(folders)
    (t,) = make_tables(runs)
    t4 = table4(t)
    final = {alg: [r["summary"] for r in runs if r["summary"]["algorithm"] == alg]
             for alg in ("fedavg", "fedprox", "fedmargin")}
    mmd_b = np.mean([s["mmd"] for s in final["fedavg"]])
    for alg in ("fedprox", "fedmargin"):
        mmd_a = np.mean([s["mmd"] for s in final[alg]])
        assert t4["ffd"][alg] == pytest.approx(100 * (mmd_b - mmd_a) / mmd_b)
        amm = [s["amm"] for s in final[alg]]
        assert t4["amm"][alg]["mean"] == pytest.approx(np.mean(amm))
        assert t4["amm"][alg]["std"] == pytest.approx(np.std(amm))
    assert t4["ffd"]["fedavg"] == pytest.approx(0.0)
    # Pearson: numpy's correlation and the t-distribution's two-sided p-value
    a = np.array([r["summary"]["amm"] for r in runs])
    b = np.array([r["summary"]["accuracy"] for r in runs])
    rho = np.corrcoef(a, b)[0, 1]
    tstat = rho * np.sqrt((len(a) - 2) / (1 - rho**2))
    p = 2 * sps.t.sf(abs(tstat), len(a) - 2)
    assert t4["pearson"]["rho"] == pytest.approx(rho)
    assert t4["pearson"]["p"] == pytest.approx(p, rel=1e-6)
    text = compare(folders)
    assert "| FFD vs fedavg (%) | 0 (reference) |" in text
    assert f"Pearson rho(final AMM, accuracy) = {rho:.2f} (p = {p:.2g}, 9 runs)" in text


def test_ffd_not_measured_and_pearson_not_computable_say_so(tmp_path):
    make_run(tmp_path / "a", "fedavg")
    make_run(tmp_path / "b", "fedmargin")
    text = compare([tmp_path / "a", tmp_path / "b"])
    assert "FFD not measured: no run logged `mmd`" in text and "| FFD vs" not in text
    assert "| AMM |" in text and "not computable (2 runs with both" in text


# ---- compare never damages anything (issue 13, item 2) ----

def test_out_inside_a_run_folder_is_refused_and_the_run_survives(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    _one_line_exit_2(["compare", str(run), "--out", str(run / "summary.md")], capsys,
                     "inside the run folder")
    _one_line_exit_2(["compare", str(run), "--out", str(run / "sub" / "t.md")], capsys,
                     "inside the run folder")
    other = make_run(tmp_path / "other")
    _one_line_exit_2(["compare", str(run), "--out", str(other / "t.md")], capsys,
                     "inside the run folder")
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    assert main(["compare", str(run)]) == 0  # still readable


def test_the_same_run_twice_is_refused(tmp_path, capsys):
    run = make_run(tmp_path / "runs" / "a")
    _one_line_exit_2(["compare", str(run), str(run)], capsys, "given twice")
    _one_line_exit_2(["compare", str(tmp_path / "runs"), str(run)], capsys, "given twice")
    _one_line_exit_2(["compare", str(run), str(tmp_path / "runs" / ".." / "runs" / "a")],
                     capsys, "given twice")


def test_existing_outputs_need_overwrite(tmp_path, capsys):
    make_run(tmp_path / "runs" / "a")
    out = tmp_path / "t.md"
    assert main(["compare", str(tmp_path / "runs"), "--out", str(out)]) == 0
    json_before = out.with_suffix(".json").read_text()
    out.write_text("mine")
    _one_line_exit_2(["compare", str(tmp_path / "runs"), "--out", str(out)], capsys,
                     "already exists; use --overwrite")
    assert out.read_text() == "mine" and out.with_suffix(".json").read_text() == json_before
    out.unlink()  # a leftover .json alone also blocks: nothing is half-replaced
    _one_line_exit_2(["compare", str(tmp_path / "runs"), "--out", str(out)], capsys,
                     "t.json already exists")
    assert not out.exists()
    assert main(["compare", str(tmp_path / "runs"), "--out", str(out), "--overwrite"]) == 0
    row = next(line for line in out.read_text().splitlines() if line.startswith("| fedavg | 1 |"))
    assert "| 0.5" in row and "±" not in row  # one run: its values, no "± 0.0000"


def test_unwritable_out_and_a_foreign_summary_are_one_line(tmp_path, capsys):
    run = make_run(tmp_path / "runs" / "a")
    (tmp_path / "file").write_text("x")
    _one_line_exit_2(["compare", str(run), "--out", str(tmp_path / "file" / "t.md")], capsys,
                     "a folder on its path is a file")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "summary.json").write_text(json.dumps({"table": 1}))
    (bad / "config.json").write_text("{}")
    (bad / "metrics.jsonl").write_text("")
    _one_line_exit_2(["compare", str(bad)], capsys, "not a protofl run summary")


def test_tables_come_in_natural_order_of_their_settings():
    assert sorted(["shapes (α=1.0)", "shapes (α=0.1)", "shapes (α=0.01)", "digits (k=10)",
                   "digits (k=2)"], key=natural_key) == [
        "digits (k=2)", "digits (k=10)", "shapes (α=0.01)", "shapes (α=0.1)", "shapes (α=1.0)"]


def test_runs_of_different_protofl_versions_are_compared_with_a_warning(tmp_path, caplog):
    folders = [make_run(tmp_path / f"s{s}", seed=s) for s in (0, 1)]
    for folder, version in zip(folders, ("0.1.0", "0.2.0")):
        summary = json.loads((folder / "summary.json").read_text())
        summary["provenance"] = {"protofl": version}
        (folder / "summary.json").write_text(json.dumps(summary))
    with caplog.at_level("WARNING", logger="protofl"):
        load_runs(folders[:1])
        assert "different protofl versions" not in caplog.text
        load_runs(folders)
    assert "different protofl versions (0.1.0, 0.2.0)" in caplog.text
