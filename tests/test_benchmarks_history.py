"""benchmarks/history.py: a printed comparison line becomes a history row, the page's tables
show the latest row per (workload, other, device), and the committed page is generated from the
committed history."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_history", ROOT / "benchmarks" / "history.py")
history = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(history)

CTX = {"machine": {"cpu": "Test CPU", "cores": 2, "gpu": None}, "torch": "2.0",
       "commit": "abc1234", "dirty": False, "command": "python benchmarks/speed.py --quick"}


def test_a_printed_line_is_parsed_into_its_figures():
    line = ("[mnist-protocol-real fedmargin] vs loop: protofl 16.75 s/round, other 27.14 "
            "s/round, ratio 1.62\n")
    assert history.parse(line) == {"workload": "mnist-protocol-real fedmargin", "other": "loop",
                                   "protofl_s": 16.75, "other_s": 27.14, "ratio": 1.62}
    assert history.parse("[flower-deploy site build] vs cold: protofl 0.495 s/round, other "
                         "6.172 s/round, ratio 12.48 (600 images)")["workload"] == \
        "flower-deploy site build"
    # lines of other forms are not rows
    assert history.parse("[fedproto] vs htfllib: protofl 1.200 s/round, other n/a") is None
    assert history.parse("[mnist] metrics overhead: default 8.945 s/round, off 8.552 s/round, "
                         "ratio 1.05") is None
    assert history.parse("      loop: 0.2934 s/round (min 0.2914, max 0.3085)") is None


def test_a_row_holds_the_line_the_date_and_the_run(tmp_path):
    now = datetime(2026, 12, 7, 18, 30, 59, tzinfo=timezone.utc)
    r = history.row("[mlp] vs loop: protofl 0.1012 s/round, other 0.2507 s/round, ratio 2.48",
                    CTX, now)
    assert r["date"] == "2026-12-07T18:30Z"
    assert (r["workload"], r["other"], r["protofl_s"], r["other_s"], r["ratio"]) == \
        ("mlp", "loop", 0.1012, 0.2507, 2.48)
    assert r["commit"] == "abc1234" and r["machine"]["cores"] == 2
    assert isinstance(r["load"], float)
    assert history.row("== LEAF CNN 28x28", CTX, now) is None
    path = tmp_path / "h.jsonl"
    history.append(r, path)
    history.append({**r, "ratio": 3.0}, path)
    assert [x["ratio"] for x in history.load(path)] == [2.48, 3.0]
    assert len(path.read_text().splitlines()) == 2


def _r(workload, other, x, y, date, command="cmd"):
    return {"workload": workload, "other": other, "protofl_s": x, "other_s": y,
            "ratio": round(y / x, 2), "date": date, "machine": {"cpu": None, "cores": 2},
            "command": command}


def test_render_shows_the_latest_row_per_workload_and_other():
    rows = [_r("mlp", "loop", 1.0, 2.0, "2026-12-02T10:00Z", "old"),
            _r("mlp", "loop", 1.0, 3.0, "2026-12-03T10:00Z", "new"),
            _r("mlp", "loop", 1.0, 9.0, "2026-12-01", "older"),  # later in the file, older date
            _r("mlp", "flower", 1.0, 5.0, "2026-12-03T10:00Z", "new"),
            _r("cnn", "loop", 2.0, 3.0, "2026-12-01T09:00Z"),
            _r("cnn", "loop", 2.0, 4.0, "2026-12-01T09:00Z", "tie"),  # same date: the later row
            {**_r("mlp", "loop", 0.5, 5.0, "2026-11-01", "gpu"),  # older, but on a GPU
             "machine": {"gpu": "NVIDIA H200", "cores": 16}}]
    best = history.latest(rows)
    assert {k: v["ratio"] for k, v in best.items()} == \
        {("mlp", "loop", "CPU"): 3.0, ("mlp", "flower", "CPU"): 5.0, ("cnn", "loop", "CPU"): 2.0,
         ("mlp", "loop", "NVIDIA H200"): 10.0}
    page = history.render(rows)
    assert page.startswith(history.BEGIN) and page.rstrip().endswith(history.END)
    assert page.count("### ") == 2 and page.index("### cnn") < page.index("### mlp")
    mlp = page[page.index("### mlp"):]
    assert "| flower | CPU | 1.0 | 5.0 | 5.0 | 1 |" in mlp
    assert "| loop | CPU | 1.0 | 3.0 | 3.0 | 1 |" in mlp and "| loop | NVIDIA H200 | 0.5 |" in mlp
    assert "1. 2026-12-03T10:00Z, 2 cores: `new`" in mlp
    assert "`old`" not in page and "`older`" not in page and "| 2.0 | 3.0 | 1.5 |" not in page
    assert "of 7 rows" in page


def test_write_page_replaces_only_the_generated_part(tmp_path):
    page = tmp_path / "README.md"
    page.write_text(f"# Head\n\nprose\n\n{history.BEGIN}\nstale\n{history.END}\n\ntail\n")
    rows = [_r("mlp", "loop", 1.0, 2.0, "2026-12-02T10:00Z")]
    history.write_page(rows, page)
    text = page.read_text()
    assert text.startswith("# Head\n\nprose\n\n") and text.endswith("\n\ntail\n")
    assert history.generated(text) == history.render(rows) and "stale" not in text
    with pytest.raises(ValueError, match="markers"):
        history.generated("# no markers\n")


def test_the_committed_page_is_generated_from_the_committed_history():
    rows = history.load(history.HISTORY)
    assert history.generated(history.README.read_text(encoding="utf-8")) == history.render(rows)
    assert len(history.README.read_bytes()) < 15_000


def test_a_bad_history_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "h.jsonl"
    bad.write_text(json.dumps(_r("mlp", "loop", 1.0, 2.0, "2026-12-02")) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"h.jsonl:2: not a JSON row"):
        history.load(bad)
    bad.write_text('{"workload": "mlp"}\n')
    monkeypatch.setattr(sys, "argv", ["history.py", "--history", str(bad), "--page",
                                      str(tmp_path / "README.md")])
    with pytest.raises(SystemExit) as e:
        history.main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lacks other" in err


def test_hook_records_printed_lines_and_is_switched_off(tmp_path, monkeypatch):
    path = tmp_path / "h.jsonl"
    monkeypatch.setattr(history, "context", lambda argv: dict(CTX))
    monkeypatch.setattr(sys, "stdout", sys.stdout)  # restored after the test
    monkeypatch.setattr(sys, "argv", ["speed.py", "--quick", "--no-history"])
    assert history.hook(path) is False and sys.argv == ["speed.py", "--quick"]
    monkeypatch.setenv(history.ENV, "0")
    assert history.hook(path) is False
    monkeypatch.delenv(history.ENV)
    assert history.hook(path) is True
    print("== header\n[cnn] vs flower: protofl 0.3477 s/round, other 1.4289 s/round, ",
          end="")
    assert not path.exists()  # the line is not complete yet
    print("ratio 4.11\nlast")
    (r,) = history.load(path)
    assert (r["workload"], r["other"], r["ratio"], r["commit"]) == ("cnn", "flower", 4.11,
                                                                    "abc1234")


@pytest.mark.skipif(shutil.which("git") is None or subprocess.run(
    ["git", "-C", str(ROOT), "rev-parse"], capture_output=True).returncode != 0,
    reason="not a git checkout")
def test_context_names_the_commit_and_the_command():
    ctx = history.context([str(ROOT / "benchmarks" / "speed.py"), "--quick", "--variants", "a b"])
    assert ctx["command"] == "python benchmarks/speed.py --quick --variants 'a b'"
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    assert ctx["commit"] == head and isinstance(ctx["dirty"], bool)
    assert ctx["machine"]["cores"] >= 1


def test_every_script_that_prints_comparison_lines_records_them():
    printing = [p for p in (ROOT / "benchmarks").glob("*.py") if p.name != "history.py"
                and "protofl {" in p.read_text() and "ratio {" in p.read_text()]
    assert {p.name for p in printing} >= {"speed.py", "heavy_tail.py", "flower_sim.py"}
    for p in printing:
        assert "history.hook()" in p.read_text(), p.name
