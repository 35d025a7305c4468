import json
import re
import shutil
import subprocess

import pytest
from fakeruns import make_run

from protofl.cli import main

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _suite(root, seeds=(0, 1)):
    """Two tables: synthetic (fedavg, fedprox, fedmargin, with mmd) and an IID one with a
    segmentation figure; a stats.json in one run folder."""
    for alg in ("fedavg", "fedprox", "fedmargin"):
        for seed in seeds:
            make_run(root / "synthetic" / alg / f"seed{seed}", alg, seed, mmd=True,
                     weights=alg == "fedmargin", accuracy={"fedavg": 0.5, "fedprox": 0.6,
                                                           "fedmargin": 0.7}[alg])
    stats = {"dataset": "synthetic(1,1)", "clients": 6, "samples_per_client":
             {"min": 50, "median": 61.5, "mean": 70.2, "max": 130}}
    (root / "synthetic" / "fedavg" / "seed0" / "stats.json").write_text(json.dumps(stats))
    iid = make_run(root / "iid" / "fedavg" / "seed0", "fedavg",
                   raw={"data": {"partition": "iid"}})
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(1, 1))
    fig.savefig(iid / "segmentation.png")
    plt.close(fig)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """A fake suite and its HTML report, made once for the tests below."""
    root = tmp_path_factory.mktemp("report")
    _suite(root / "suite")
    assert main(["report", str(root / "suite"), "--out", str(root / "report.html")]) == 0
    return root


def test_report_html_is_self_contained_and_complete(report, capsys):
    out = report / "report.html"
    html = out.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)|url\((https?:|//)|@import""",
                         html)
    assert "default-src 'none'" in html  # the browser may fetch nothing
    for text in ("synthetic(1,1)", "synthetic(1,1) (iid)", "6 clients, 3 per round",
                 "wall-clock s", "FFD vs fedavg (%)", "0 (reference)",
                 "Pearson rho(final AMM, accuracy)", "samples per client",
                 "min: 50, median: 61.5", "data:image/png;base64,", "aggregation weights",
                 '"algorithm": "fedmargin"', "Not recorded: no run folder here holds"):
        assert text in html, text
    # curves: one per logged numeric metric, plus FFD, in the synthetic table; a metric
    # that never varies gets a line instead of a flat curve
    assert html.count('<figure class="curve"') >= 8
    assert "The same in every run and round: clients_evaluated = 6." in html
    assert ">clients_evaluated</text>" not in html
    assert main(["report", str(report / "suite"), "--out", str(out)]) == 2  # exists
    assert "--overwrite" in capsys.readouterr().err


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not found (apt-get install chromium)")
def test_report_renders_in_headless_chromium(report, tmp_path):
    out = report / "report.html"
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr",
         "--v=0", "--dump-dom", f"file://{out}#selftest"],
        capture_output=True, text=True, timeout=120)
    dom, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, err[-2000:]
    console = [line for line in err.splitlines() if "CONSOLE" in line]
    assert not console, console  # no script error, no message at all
    assert 'data-ready="yes"' in dom
    assert re.search(r'<pre id="errors" hidden="?"?></pre>', dom)  # no script error caught
    selftest = json.loads(re.search(r'data-selftest="([^"]*)"', dom).group(1)
                          .replace("&quot;", '"').replace("&amp;", "&"))
    assert "round" in selftest["tip"] and "fedavg:" in selftest["tip"]  # hover values
    assert selftest["hiddenAfterToggle"] is True  # a method toggled off disappears
    assert dom.count("<svg") >= 10
    for row in ("fedavg", "fedprox", "fedmargin"):
        assert re.search(rf"<tr><td><span[^>]*></span>{row}</td><td>2</td>", dom), row


def test_report_markdown_regenerates_sections_and_keeps_prose(tmp_path, capsys):
    _suite(tmp_path / "suite")
    md = tmp_path / "docs" / "results.md"
    assert main(["report", str(tmp_path / "suite"), "--markdown", str(md)]) == 0
    assert not (tmp_path / "report.html").exists()  # --markdown alone writes no HTML
    text = md.read_text()
    assert "| fedmargin | 2 |" in text and "| FFD vs fedavg (%) | 0 (reference) |" in text
    figs = re.findall(r"\]\((img/[^)]+\.png)\)", text)
    assert figs and all((md.parent / f).exists() for f in figs)
    md.write_text(text.replace("# Results", "# Results\n\nMy own words.")
                  .replace("| fedmargin | 2 |", "| stale | 2 |"))
    assert main(["report", str(tmp_path / "suite"), "--markdown", str(md)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "suite"), "--markdown", str(md), "--overwrite"]) == 0
    text = md.read_text()
    assert "My own words." in text and "| stale |" not in text and "| fedmargin | 2 |" in text


def test_report_is_never_written_into_a_run_and_counts_runs_once(tmp_path, capsys):
    run = make_run(tmp_path / "runs" / "a")
    for args, needle in (([str(run), "--out", str(run / "report.html")], "inside the run"),
                         ([str(tmp_path / "runs"), str(run)], "given twice"),
                         ([str(tmp_path / "nothing")], "not a run folder")):
        assert main(["report", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1


def test_report_of_real_runs(tmp_path):
    tiny = ["--rounds", "2", "--set", "clients.per_round=2", "--set", "data.num_clients=4",
            "--set", "clients.local_steps=1", "--set", "metrics.dissimilarity_clients=2"]
    assert main(["run", "-q", "--out", str(tmp_path / "run"), *tiny]) == 0  # fedmargin
    out = tmp_path / "r.html"
    assert main(["report", str(tmp_path / "run"), "--out", str(out)]) == 0
    html = out.read_text()
    assert "4 clients, 2 per round, 2 rounds of 1 local steps" in html
    assert "aggregation weights" in html and "FFD: not measured" in html


def test_a_metric_logged_once_keeps_its_curve_and_a_flat_one_is_a_line():
    from protofl.report.figures import numeric_metrics

    runs = [[{"round": 1, "accuracy": 0.5, "clients_evaluated": 6, "once": 2.0},
             {"round": 2, "accuracy": 0.6, "clients_evaluated": 6, "flag": True}]]
    keys, flat = numeric_metrics(runs)
    assert keys == ["accuracy", "once"] and flat == {"clients_evaluated": 6.0}


def test_a_group_keeps_its_colour_in_every_panel():
    """A group drawn in a panel where an earlier group is missing keeps its own colour (the
    AMM panel of a suite whose first methods log no AMM drew them in the others' colours)."""
    from matplotlib.colors import to_hex

    from protofl.report.canvas import color
    from protofl.report.plots import groups_figure

    rows = lambda amm: [{"round": t, "accuracy": 0.1 * t, **({"amm": t} if amm else {})}  # noqa: E731
                        for t in (1, 2)]
    fig = groups_figure({"fd": [rows(False)], "fedproto": [rows(True)]})
    titles = [ax.get_title() for ax in fig.axes]
    accuracy, amm = (fig.axes[titles.index(t)] for t in ("test accuracy",
                                                          "aggregate mean margin"))
    assert [to_hex(line.get_color()) for line in accuracy.lines] == [color(0), color(1)]
    assert [to_hex(line.get_color()) for line in amm.lines] == [color(1)]
