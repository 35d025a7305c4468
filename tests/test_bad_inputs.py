"""Bad and edge inputs a new user tries (issue 23, items 5 and 6): each gets one clear line and
exit code 2 (3 for a diverged run) or the documented behaviour, never a traceback; nothing
already written is lost. Every run here is one or two rounds of a few tiny clients."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import re
import resource
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from fakeruns import make_run

from protofl.cli import main
from protofl.config import ClientConfig, DataConfig, apply_set, load_raw
from protofl.data import fetch as F
from protofl.data.leaf import write_leaf
from protofl.data.registry import load_dataset
from protofl.data.sources import SOURCES, DataSource, FileSource
from protofl.engine import runfolder, trainers
from protofl.errors import Diverged, ProtoflError
from protofl.models.pretrained import read_state_dict
from protofl.report.compare import compare, load_runs, make_tables

# a one- or two-round run of three tiny clients on Synthetic(1,1)
TINY = ["--set", "data.num_clients=3", "--set", "clients.per_round=2", "--set",
        "clients.local_steps=1", "--set", "clients.batch_size=8", "--set",
        "metrics.dissimilarity_clients=0", "--set", "metrics.train_loss_samples=20",
        "--set", "threads=1", "-q"]


def cli(capsys, *args: str) -> tuple[int, str]:
    """``protofl ARGS``: the exit code and the error line (asserted to be the only one)."""
    code = main(list(args))
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("protofl: error:")]
    if code:
        assert len(lines) == 1, err
        return code, lines[0]
    return code, ""


def tiny_run(capsys, out: Path, *extra: str) -> None:
    code, line = cli(capsys, "run", "--rounds", "1", "--out", str(out), *TINY, *extra)
    assert code == 0, line


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """One finished one-round fedavg run folder (with its checkpoint)."""
    out = tmp_path_factory.mktemp("runs") / "fedavg"
    assert main(["run", "--algorithm", "fedavg", "--rounds", "1", "--out", str(out),
                 *TINY]) == 0
    return out


MAX_CLASSES = 100_000  # data/leaf.py's documented cap

# ---- item 5: input that exhausts the machine ----

def test_workers_above_the_usable_cores_are_capped_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(trainers, "usable_cores", lambda: 2)
    with caplog.at_level(logging.WARNING, "protofl"):
        assert trainers.resolve_workers(1000) == 2
    assert "workers = 1000 exceeds the 2 usable CPU cores; using 2" in caplog.text
    assert trainers.resolve_workers(None) == 2 and trainers.resolve_workers(1) == 1


def leaf_folder(root: Path, ys: list[list[int]]) -> Path:
    xs = [np.zeros((len(y), 3), np.float32) for y in ys]
    write_leaf(root / "train", [f"u{i}" for i in range(len(ys))], xs, ys)
    return root


def test_leaf_labels_implying_a_huge_class_count_are_refused(tmp_path):
    leaf_folder(tmp_path, [[0, 1], [MAX_CLASSES, 2]])  # labels 0..100000: 100001 classes
    with pytest.raises(ProtoflError, match="implies 100001 classes.*at most 100000"):
        load_dataset(DataConfig(name="leaf", root=str(tmp_path)))
    leaf_folder(tmp_path, [[0, 1], [MAX_CLASSES - 1, 2]])
    assert load_dataset(DataConfig(name="leaf", root=str(tmp_path))).num_classes == MAX_CLASSES


def test_leaf_label_of_two_billion_is_one_line_before_any_allocation(tmp_path, capsys):
    leaf_folder(tmp_path / "d", [[0, 1], [2 * 10**9, 2], [1, 0]])
    code, line = cli(capsys, "run", "--dataset", "leaf", "--set", f"data.root={tmp_path / 'd'}",
                     "--out", str(tmp_path / "run"), *TINY)
    assert code == 2 and "2000000001 classes" in line


def test_leaf_users_without_samples_are_one_line(tmp_path, capsys):
    leaf_folder(tmp_path / "d", [[], [], []])
    code, line = cli(capsys, "run", "--dataset", "leaf", "--set", f"data.root={tmp_path / 'd'}",
                     "--out", str(tmp_path / "run"), *TINY)
    assert code == 2 and "no user holds a training sample" in line


# ---- item 6: tracebacks ----

def test_resume_with_another_algorithms_checkpoint_is_refused_up_front(tmp_path, capsys,
                                                                         finished):
    other = tmp_path / "fedproto"
    tiny_run(capsys, other, "--algorithm", "fedproto", "--set", "rounds=2",
             "--set", "checkpoint_every=1")
    (other / "summary.json").unlink()  # as if killed after round 1... with a foreign file:
    shutil.copy(finished / runfolder.CHECKPOINT, other / runfolder.CHECKPOINT)
    before = (other / runfolder.METRICS).read_text()
    code, line = cli(capsys, "run", "--resume", str(other), "-q")
    assert code == 2 and "checkpoint.safetensors differs from round 2's checkpoint" in line
    (other / "manifest.json").unlink()  # a folder written before manifests: the state tells
    code, line = cli(capsys, "run", "--resume", str(other), "-q")
    assert code == 2 and "checkpoint is a fedavg run's" in line and "fedproto" in line
    # a checkpoint written before the algorithm was recorded: its state's entries tell
    snap = runfolder.load_checkpoint(finished)
    del snap["algorithm"]
    runfolder.save_checkpoint(other, snap)
    code, line = cli(capsys, "run", "--resume", str(other), "-q")
    assert code == 2 and "does not match config.json's fedproto run" in line
    assert (other / runfolder.METRICS).read_text() == before  # no round was trained


def test_a_full_disk_while_checkpointing_is_one_line_and_loses_nothing(tmp_path, capsys,
                                                                       monkeypatch):
    real = os.fsync
    writes = []

    def fsync(fd):  # the second checkpoint write finds the disk full
        if os.readlink(f"/proc/self/fd/{fd}").endswith(runfolder.CHECKPOINT + ".tmp"):
            writes.append(fd)
            if len(writes) == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to tell the files apart")
    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "run"
    code, line = cli(capsys, "run", "--rounds", "2", "--set", "checkpoint_every=1",
                     "--out", str(out), *TINY)
    assert code == 2 and "No space left on device" in line
    assert "checkpoint of round 1 is intact" in line and f"--resume {out}" in line
    assert runfolder.load_checkpoint(out)["round"] == 1
    assert not list(out.glob("*.tmp"))
    monkeypatch.setattr(os, "fsync", real)  # space freed: the run resumes and ends
    assert cli(capsys, "run", "--resume", str(out), "-q")[0] == 0
    assert [r["round"] for r in runfolder.read_metrics(out)] == [1, 2]


@pytest.mark.parametrize("argv, says", [
    (["--seeds", "a,b"], "--seeds 'a,b': expected comma-separated integers"),
    (["--seeds", "0,0"], "a seed is given twice"),
    (["--jobs", "0"], "--jobs 0: give at least 1"),
    (["--jobs", "-1"], "--jobs -1: give at least 1")])
def test_suite_seeds_and_jobs_are_checked(tmp_path, capsys, monkeypatch, argv, says):
    import protofl.suites

    monkeypatch.setattr(protofl.suites, "run_suite", lambda *a, **k: "ran")  # never runs
    code, line = cli(capsys, "suite", "main", "--out", str(tmp_path / "s"), *argv)
    assert code == 2 and says in line


@pytest.mark.parametrize("samples", ["0", "-5", "2"])
def test_tsne_samples_below_three_are_refused(finished, capsys, samples):
    code, line = cli(capsys, "tsne", str(finished), "--samples", samples)
    assert code == 2 and "t-SNE needs at least 3 samples" in line
    assert not (finished / "tsne.png").exists()


def test_a_pickled_pretrained_file_is_one_line_without_torchs_advice(tmp_path):
    torch.save(torch.nn.Linear(2, 2), tmp_path / "model.pt")  # a whole module: pickled code
    with pytest.raises(ProtoflError) as e:
        read_state_dict(tmp_path / "model.pt")
    text = str(e.value)
    assert "\n" not in text and "weights_only" not in text
    assert "pickled objects besides tensors" in text and "state_dict()" in text


# ---- item 6: silent wrong results ----

def test_the_explosion_bound_is_100_times_the_uniform_cross_entropy():
    from protofl.engine.divergence import check_loss, explosion_bound

    assert explosion_bound(10) == pytest.approx(100 * 2.302585093)  # 100 ln 10
    c = ClientConfig(lr=0.01, weight_decay=0.0)
    check_loss({"round": 1, "loss": 230.0}, 10, c)  # below: nothing
    check_loss({"round": 1, "loss": float("nan")}, 10, c)  # NaN is the NaN checks' business
    check_loss({"round": 1, "loss": 1e9}, 10, c, noised=True)  # DP noise: off
    with pytest.raises(Diverged, match=r"round 3: the train loss .* exploded to 231"):
        check_loss({"round": 3, "loss": 2.0, "train_loss": 231.0}, 10, c)
    with pytest.raises(Diverged, match="exploded to inf"):
        check_loss({"round": 1, "loss": math.inf}, 2, c)


def test_the_remedy_names_the_weight_decay_when_it_is_the_cause():
    from protofl.engine.divergence import remedy

    assert remedy(ClientConfig(lr=0.05, weight_decay=0.0)) == "lower clients.lr (now 0.05)"
    assert remedy(ClientConfig(lr=0.01, weight_decay=5e-4)).startswith("lower clients.lr")
    text = remedy(ClientConfig(lr=0.01, weight_decay=1e30))
    assert text.startswith("clients.weight_decay = 1e+30 is the likely cause") and "lr" in text
    assert "weight_decay" in remedy(ClientConfig(lr=0.01, weight_decay=200.0))  # lr·wd = 2


def test_a_loss_that_explodes_without_nan_stops_the_run_with_exit_3(tmp_path, capsys):
    out = tmp_path / "run"
    code, line = cli(capsys, "run", "--rounds", "2", "--set", "clients.lr=1e6",
                     "--out", str(out), *TINY)
    assert code == 3 and "round 1: the loss of the aggregate model exploded" in line
    assert "has no checkpoint yet" in line
    assert not (out / runfolder.SUMMARY).exists()


def test_a_huge_weight_decay_is_named_as_the_cause(tmp_path, capsys):
    code, line = cli(capsys, "run", "--rounds", "2", "--set", "clients.weight_decay=1e30",
                     "--out", str(tmp_path / "run"), *TINY, "--set", "clients.local_steps=3")
    assert code == 3 and "clients.weight_decay = 1e+30 is the likely cause" in line
    assert "lower clients.lr" not in line


@pytest.mark.parametrize("key", ["max_samples", "image_size"])
def test_data_keys_a_vector_dataset_ignores_are_warned(caplog, key):
    with caplog.at_level(logging.WARNING, "protofl"):
        load_dataset(DataConfig(name="synthetic", num_clients=3, **{key: 10}))
    assert f"data.{key} = 10 is ignored: dataset 'synthetic' does not use it" in caplog.text


def test_the_simulated_secure_sums_apply_secagg_range(tmp_path, capsys):
    args = ["run", "--algorithm", "fedavg", "--rounds", "1", "--set", "privacy.secagg=true",
            *TINY]
    code, line = cli(capsys, *args, "--set", "privacy.secagg_range=1e-6",
                     "--out", str(tmp_path / "small"))
    assert code == 2 and "outside privacy.secagg_range = 1e-06; raise it" in line
    assert cli(capsys, *args, "--out", str(tmp_path / "default"))[0] == 0  # the default fits


def test_an_empty_set_value_is_refused():
    with pytest.raises(ProtoflError, match="no value; write clients.lr=null for the default"):
        apply_set({}, "clients.lr=")
    raw: dict = {}
    apply_set(raw, "clients.lr=null")  # the way to ask for the default
    assert raw == {"clients": {"lr": None}}


@pytest.mark.parametrize("name, text, key", [
    ("c.yaml", "rounds: 1\nclients:\n  lr: 0.1\n  lr: 0.2\n", "'lr' is given twice (line 4)"),
    ("c.json", '{"rounds": 1, "rounds": 2}', "'rounds' is given twice")])
def test_duplicate_config_keys_are_refused(tmp_path, capsys, name, text, key):
    (tmp_path / name).write_text(text)
    code, line = cli(capsys, "run", str(tmp_path / name), "--out", str(tmp_path / "run"))
    assert code == 2 and key in line and not (tmp_path / "run").exists()
    (tmp_path / "m.yaml").write_text("base: &b {lr: 0.1}\nclients:\n  <<: *b\n  lr: 0.2\n")
    assert load_raw(tmp_path / "m.yaml")["clients"] == {"lr": 0.2}  # a merge key may be overridden


# ---- item 6: paths ----

def test_tilde_is_expanded_in_every_output_and_run_path(tmp_path, capsys, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    tiny_run(capsys, Path("~/run"))
    assert (home / "run" / runfolder.SUMMARY).is_file()
    assert cli(capsys, "run", "--resume", "~/run", "--rounds", "2", "-q")[0] == 0
    assert cli(capsys, "compare", "~/run", "--out", "~/t/table.md")[0] == 0
    assert cli(capsys, "report", "~/run", "--out", "~/t/report.html")[0] == 0
    assert cli(capsys, "stats", "--set", "data.num_clients=3", "--out", "~/t/stats")[0] == 0
    assert cli(capsys, "tsne", "~/run", "--samples", "20")[0] == 0
    assert {"table.md", "report.html", "stats"} <= {p.name for p in (home / "t").iterdir()}
    assert (home / "run" / "tsne.png").is_file()
    assert list(cwd.iterdir()) == []  # no folder named ~


# ---- item 6: reports ----

def test_compare_out_never_names_a_run_folders_file(tmp_path):
    runs = [make_run(tmp_path / "r0")]
    for name in ("summary.md", "config.md"):
        with pytest.raises(ProtoflError, match="the name of a run folder's file"):
            compare(runs, tmp_path / "out" / name)
    assert not (tmp_path / "out" / "summary.json").exists()
    compare(runs, tmp_path / "out" / "table.md")
    assert (tmp_path / "out" / "table.json").is_file()


def test_a_table_of_mixed_rounds_and_seeds_names_the_mix(tmp_path):
    def caption(*specs):
        return make_tables(load_runs([make_run(tmp_path / f"{a}{s}{r}", a, s, r)
                                      for a, s, r in specs]))[0].caption

    alike = caption(("fedavg", 0, 5), ("fedavg", 1, 5), ("fedprox", 0, 5), ("fedprox", 1, 5))
    assert "mix" not in alike
    seeds = caption(("fedavg", 0, 5), ("fedavg", 1, 5), ("fedprox", 0, 5))
    assert "the rows mix runs: fedavg: seed 0, 1; fedprox: seed 0" in seeds
    rounds = caption(("fedavg", 0, 5), ("fedavg", 1, 3))
    assert "seed 0 (5 rounds)" in rounds and "seed 1 (3 rounds)" in rounds


# ---- item 6: messages that mislead ----

def test_a_read_only_fetch_root_says_so_not_no_space(tmp_path, monkeypatch):
    fs = FileSource("x.bin", ("http://127.0.0.1:9/x.bin",), md5="0" * 32, size=10)
    monkeypatch.setitem(SOURCES, "ro", DataSource("ro", "mnist", "t", (fs,)))
    monkeypatch.setattr(F.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1, 1, 0))

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(F.tempfile, "TemporaryFile", read_only)
    with pytest.raises(ProtoflError, match="cannot write to .*: Read-only file system") as e:
        F.fetch("ro", tmp_path, progress=False)
    assert "no space" not in str(e.value)


def test_a_file_as_data_root_says_it_is_a_file(tmp_path):
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"\0" * 16)
    for name in ("mnist", "leaf"):
        with pytest.raises(ProtoflError, match="is a file; .*data.root is (the|a) folder"):
            load_dataset(DataConfig(name=name, root=str(tmp_path / "train-images-idx3-ubyte")))


def test_femnist_without_qualifying_users_names_the_cause(tmp_path):
    xs = [np.zeros((3, 784), np.float32)] * 2
    write_leaf(tmp_path / "train", ["w0", "w1"], xs, [[0, 1, 2], [3, 4, 5]])  # digits only
    with pytest.raises(ProtoflError, match="none of its 2 users holds samples of 5 of the "
                                           "letters a-j") as e:
        load_dataset(DataConfig(name="femnist", root=str(tmp_path)))
    assert "lower data.num_clients" not in str(e.value)
    ys = [[36, 37, 38, 39, 40]] * 2  # two users with 5 letters each; 200 clients asked
    write_leaf(tmp_path / "train", ["w0", "w1"], [np.zeros((5, 784), np.float32)] * 2, ys)
    with pytest.raises(ProtoflError, match="the default 200.*at most 2"):
        load_dataset(DataConfig(name="femnist", root=str(tmp_path)))


def test_docs_budget_example_settings_run_under_their_budget():
    """docs/privacy.md's budget example (fedmargin on Synthetic, noise 4, budget 8): its
    first round's epsilon is below the budget, so it runs (and stops after round 4)."""
    from protofl.config import config_from_dict
    from protofl.engine.experiment import Experiment

    text = (Path(__file__).parents[1] / "docs" / "privacy.md").read_text()
    assert "--set privacy.noise_multiplier=4.0 --set privacy.budget=8" in text
    exp = Experiment(config_from_dict({"privacy": {"noise_multiplier": 4.0, "budget": 8},
                                       "threads": 1}))
    from protofl.engine.private import Accounting
    from protofl.privacy.noise import effective_multiplier

    agg = exp.aggregation
    accountant = next(layer for layer in agg.layers if isinstance(layer, Accounting)).accountant
    eps = [accountant.epsilon_of([effective_multiplier(agg.plan())] * t) for t in (1, 4, 5)]
    assert eps[0] < 8 and eps[1] < 8 < eps[2]


def test_json_config_without_duplicates_still_loads(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"rounds": 1, "clients": {"lr": 0.1}}))
    assert load_raw(tmp_path / "c.json") == {"rounds": 1, "clients": {"lr": 0.1}}


# ---- item 6: the HTML report ----

@pytest.fixture(scope="module")
def report_runs(tmp_path_factory) -> Path:
    """fedprox, fedavg and fedmargin runs (2 seeds, mmd logged) with a 10-class confusion
    matrix of 4-digit counts, in a folder of runs."""
    root = tmp_path_factory.mktemp("report") / "runs"
    m = (np.eye(10) * 1200 + 3).astype(int).tolist()
    for alg in ("fedprox", "fedavg", "fedmargin"):
        for seed in (0, 1):
            f = make_run(root / alg / f"seed{seed}", alg, seed, mmd=True)
            s = json.loads((f / runfolder.SUMMARY).read_text())
            (f / runfolder.SUMMARY).write_text(json.dumps({**s, "confusion": m}))
    return root


@pytest.fixture(scope="module")
def page(report_runs) -> str:
    from protofl.report.html import build_html
    from protofl.report.sections import sections

    return build_html(sections([report_runs]))


def test_report_confusion_counts_are_readable_and_headed(page):
    import re

    from protofl.report import assets

    assert "<h4>Confusion matrices</h4>" in page and "or segmentation" not in page
    for fig in re.findall(r'<figure class="cm"[^>]*>.*?</figure>', page, re.S):
        css = re.search(r'style="width:(\d+)px"', fig[:80])
        shown = float(css.group(1)) if css else float(
            re.search(r"figure\.cm svg\{width:(\d+)px", assets.CSS).group(1))
        drawn = float(re.search(r'<svg[^>]*width="([\d.]+)pt"', fig).group(1))
        sizes = [float(px) for px, body in re.findall(
            r'<text style="font-size: ([\d.]+)px[^>]*>\s*([^<]*)</text>', fig)
            if body.strip().isdigit() and int(body) >= 1000]  # the cells' counts
        assert sizes and min(sizes) * shown / drawn >= 9  # pixels tall on the page


def test_report_ffd_plot_has_a_legend_and_methods_in_table_md_order(report_runs, page,
                                                                      tmp_path):
    import html as H
    import re

    figs = re.findall(r'<figure class="curve" id="[^"]+" data-meta="([^"]+)"[^>]*>(.*?)'
                      r"</figure>", page, re.S)
    ffd = [svg for meta, svg in figs if json.loads(H.unescape(meta))["title"].startswith("FFD")]
    assert len(ffd) == 1 and 'id="f' in ffd[0] and "legend_1" in ffd[0]
    html_order = re.findall(r'<tr><td><span class="swatch"[^>]*></span>([^<]+)</td>', page)
    given = [report_runs / a / f"seed{s}" for a in ("fedprox", "fedmargin", "fedavg")
             for s in (0, 1)]  # compare's input order, e.g. a suite's plan
    text = compare(given, tmp_path / "t" / "table.md")
    md_order = [line.split("|")[1].strip() for line in text.splitlines()
                if line.startswith("| fed")]
    assert md_order == html_order == ["fedavg", "fedmargin", "fedprox"]


def test_summary_line_is_what_run_and_the_flower_server_print():
    from protofl.report.runs import summary_line

    s = {"algorithm": "fedavg", "dataset": "digits", "rounds": 3, "accuracy": 0.5,
         "loss": 1.25, "seconds": 2.04}
    assert summary_line(s) == "fedavg on digits, 3 rounds: accuracy 0.5000, loss 1.2500 (2.0 s)"
    assert summary_line({**s, "stopped": "privacy budget"}, Path("r")).endswith(
        "(2.0 s, stopped early: privacy budget) -> r")


def test_the_flower_server_logs_its_result_and_its_error_as_one_line(monkeypatch, caplog):
    pytest.importorskip("flwr")
    from types import SimpleNamespace

    from protofl.flower import server_app

    summary = {"algorithm": "fedavg", "dataset": "digits", "rounds": 3, "accuracy": 0.5,
               "seconds": 1.0}
    ran = SimpleNamespace(summary=lambda: summary)
    monkeypatch.setattr(server_app, "run_on_grid", lambda *a, **k: ran)
    context = SimpleNamespace(run_config={})
    with caplog.at_level(logging.INFO, "flwr"):
        assert server_app.serve(None, context, cfg=object()) is ran
    assert "protofl: fedavg on digits, 3 rounds: accuracy 0.5000 (1.0 s)" in caplog.text

    def refused(*a, **k):
        raise ProtoflError("flower: num-partitions = 2 but synthetic(1,1) has 30 clients")

    monkeypatch.setattr(server_app, "run_on_grid", refused)
    caplog.clear()
    with caplog.at_level(logging.INFO, "flwr"), pytest.raises(ProtoflError):
        server_app.serve(None, context, cfg=object())
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
        "protofl: error: flower: num-partitions = 2 but synthetic(1,1) has 30 clients"]


# ---- issue 32: sizes checked before memory is taken ----

class TookTooLong(BaseException):
    """A case ran past its budget (a BaseException: no handler of the code under test
    catches it)."""


@contextlib.contextmanager
def bounded(seconds: int, headroom: int = 4 << 30):
    """Run the body at most ``seconds`` (SIGALRM raises TookTooLong) and with at most
    ``headroom`` more bytes of data memory (RLIMIT_DATA), so a size that reaches the
    allocator fails fast instead of growing the test process until it is killed."""
    if not hasattr(signal, "SIGALRM") or not Path("/proc/self/status").is_file():
        pytest.skip("needs SIGALRM and /proc")
    used = next(int(line.split()[1]) * 1024 for line in
                Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmData:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = used + headroom if hard == resource.RLIM_INFINITY else min(hard, used + headroom)

    def alarm(signum, frame):
        raise TookTooLong(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


AS_ON_16_GIB = str(16 << 10)  # $PROTOFL_MEMORY_MB: the host memory the guard sees


def test_a_huge_prototype_size_of_a_heterogeneous_family_is_one_line(tmp_path, capsys,
                                                                      monkeypatch):
    """d = 10^8 on digits: 10^8-wide feature layers (about a terabyte) were allocated, and
    the allocator's 40-line traceback was all the user saw."""
    monkeypatch.setenv("PROTOFL_MEMORY_MB", AS_ON_16_GIB)
    with bounded(60):
        code, line = cli(capsys, "run", "--dataset", "digits", "--algorithm", "fedproto",
                         "--set", "model.family=htfe-cnn", "--set", "model.feature_dim=100000000",
                         "--out", str(tmp_path / "run"), *TINY)
    assert code == 2 and "model.feature_dim = 100000000" in line
    assert re.search(r"would take [\d.]+ [KMGTP]iB \(\d{12,} bytes\)", line), line
    assert "lower model.feature_dim" in line and not (tmp_path / "run").exists()


def test_a_leaf_label_of_99999_is_sized_before_the_run_not_by_the_allocator(tmp_path, capsys,
                                                                           monkeypatch):
    """Labels 0, 1, 2 and one 99999: 100,000 classes (under leaf.py's cap), whose C x C
    confusion matrix (and its JSON) grew the process until it was killed."""
    monkeypatch.setenv("PROTOFL_MEMORY_MB", AS_ON_16_GIB)
    leaf_folder(tmp_path / "d", [[0, 1, 2], [99_999, 2, 1], [1, 0, 2]])
    with bounded(60):
        code, line = cli(capsys, "run", "--dataset", "leaf", "--set",
                         f"data.root={tmp_path / 'd'}", "--out", str(tmp_path / "run"), *TINY)
    assert code == 2 and f"data.root = {tmp_path / 'd'}" in line
    assert "confusion matrix of its 100000 classes (4 of them present" in line
    assert "(240000000000 bytes)" in line and "number the classes 0, 1, 2" in line
    assert "more than the 16.0 GiB of memory this machine has available" in line


def test_a_label_outside_the_declared_classes_is_one_line_before_any_array(tmp_path):
    from protofl.data.federated import from_ranges

    x, y = torch.zeros(6, 2), torch.tensor([0, 1, 2, 0, 2**31, 1])
    with pytest.raises(ProtoflError, match=r"^d: a training label of 2147483648 is outside "
                                           r"the 3 classes 0 \.\. 2 the data declares$"):
        from_ranges("d", 3, x, y, [3, 3], local_test_fraction=0.0)
    with pytest.raises(ProtoflError, match="a test label of -1 is outside the 3 classes"):
        from_ranges("d", 3, x, y.clamp(max=2), [3, 3], x[:2], torch.tensor([0, -1]), 0.0)
    assert from_ranges("d", 3, x, y.clamp(max=2), [3, 3], local_test_fraction=0.0
                       ).class_counts.tolist() == [[1, 1, 1], [1, 1, 1]]


def test_byte_estimates_by_hand(monkeypatch):
    from types import SimpleNamespace

    from protofl import sizes
    from protofl.algorithms.registry import make_algorithm
    from protofl.models.nets import Mlp

    # Mlp 4 -> 5 -> 3: 4*5 + 5 + 5*3 + 3 = 43 float32 weights = 172 bytes
    alg = make_algorithm("fedavg", {}, Mlp(4, 3, hidden=(5,)), 3)
    assert sizes.module_bytes(alg.model) == (172, 172)
    spec = SimpleNamespace(clients=ClientConfig(per_round=2, optimizer="sgd", momentum=0.0))
    # the model 172 + its server state 172 + a client's weights and gradients 2 * 172 + two
    # uploads of the weights and a sample count, 2 * (172 + 4)
    assert sizes.model_bytes(alg, spec) == 172 + 172 + 344 + 352
    adam = SimpleNamespace(clients=ClientConfig(per_round=2, optimizer="adam"))
    assert sizes.model_bytes(alg, adam) == 172 + 172 + 4 * 172 + 352  # + two moments
    # 3 epochs of 100 rows in batches of 10: 300 int64 indices and 30 batch tensors
    assert sizes.schedule_bytes(100, 3, 10, by_steps=False) == 3 * (800 + 10 * 64)
    assert sizes.schedule_bytes(100, 7, 10, by_steps=True) == 7 * (10 * 8 + 64)
    assert sizes.schedule_bytes(4, 7, 10, by_steps=True) == 7 * (4 * 8 + 64)  # batch <= rows
    assert sizes.human(512) == "512 B" and sizes.human(3 << 29) == "1.5 GiB"
    monkeypatch.setenv(sizes.MEMORY_ENV, "1")  # 1 MiB available
    assert sizes.host_available() == 1 << 20
    sizes.check([sizes.Need("x.k", 5, 1 << 19, "half"), sizes.Need("x.j", 1, 1 << 19, "half")])
    with pytest.raises(ProtoflError, match=r"^config: x\.k = 5: a table would take 1\.0 MiB "
                                           r"\(1048576 bytes\) \(1\.5 MiB with the rest of "
                                           r"the run\), more than the 1\.0 MiB of memory this "
                                           r"machine has available; lower x\.k$"):
        sizes.check([sizes.Need("x.k", 5, 1 << 20, "a table"),
                     sizes.Need("x.j", 1, 1 << 19, "half")])


def test_a_personalised_runs_estimate_by_hand():
    """fedproto keeps every client's own model and a prototype table; a checkpoint copies the
    state and the clients' models three times while it encodes them."""
    from types import SimpleNamespace

    from protofl import sizes
    from protofl.algorithms.registry import make_algorithm
    from protofl.models.nets import Mlp

    alg = make_algorithm("fedproto", {}, Mlp(4, 3, hidden=(5,)), 3)  # d = 5: 172 bytes
    spec = SimpleNamespace(clients=ClientConfig(per_round=2, optimizer="sgd", momentum=0.0),
                           data=SimpleNamespace(num_clients=4), rounds=1)
    # the state: the initial model 172 + prototypes 3 x 5 floats 60 + presence 3 x 4 bytes 12
    state = 172 + 60 + 12
    own = 2 * 172  # rounds x per_round = 2 clients keep their own model
    train = 2 * 172 + 2 * (60 + 12 + 4)  # weights and gradients; 2 uploads (protos, counts, n)
    assert sizes.model_bytes(alg, spec) == 172 + state + own + max(train, 3 * (state + own))
    # with 40 rows of features (d = 5) to average into prototypes in the round
    assert sizes.model_bytes(alg, spec, round_extra=800) == 172 + state + own + max(
        train + 800, 3 * (state + own))
    # a Flower server or node: no other client's model, no checkpoint copies
    assert sizes.model_bytes(alg, spec, holds_clients=False) == 172 + state + train


FAMILY_DIMS = [(f, d) for f in ("htfe-cnn", "htfe-mixed", "htfe-img", "htfe-mlp", "htfe-img-2",
                                "htfe-img-3", "htfe-img-4", "htfe-img-5", "htfe-img-8",
                                "htc-img-4", "htfe-img-8-htc-img-4")
               for d in (10**5, 10**6, 10**7)]


def test_the_family_cases_are_every_family():
    from protofl.models.families import FAMILIES

    assert {f for f, _ in FAMILY_DIMS} == set(FAMILIES)


class Fits(ProtoflError):
    """Raised in place of building a run the guard let through (the test sizes, never runs)."""


@pytest.mark.parametrize("family, d", FAMILY_DIMS, ids=[f"{f}-{d:.0e}" for f, d in FAMILY_DIMS])
def test_feature_dim_on_every_family_is_sized_with_what_the_run_holds(tmp_path, capsys,
                                                                      monkeypatch, family, d):
    """feature_dim 10^5, 10^6, 10^7 on every family (fedproto on digits, as on a 16 GiB host):
    10^6 on htfe-cnn passed the guard and grew the process past 14 GB. The run holds at least
    each group's model, the server state's initial copy of each, and a checkpoint's three
    copies of that state: five times the models' bytes, counted here from the models built
    on the meta device; such a run must be refused before anything is allocated."""
    from protofl.data.registry import load_dataset
    from protofl.engine import federation
    from protofl.engine.spec import check_sizes
    from protofl.models.families import build_groups

    monkeypatch.setenv("PROTOFL_MEMORY_MB", AS_ON_16_GIB)

    def sized(*args):
        check_sizes(*args)
        raise Fits("sized: fits")

    monkeypatch.setattr(federation, "check_sizes", sized)
    with bounded(30, headroom=1 << 30):
        code, line = cli(capsys, "run", "--dataset", "digits", "--algorithm", "fedproto",
                         "--set", f"model.family={family}", "--set", f"model.feature_dim={d}",
                         "--out", str(tmp_path / "run"), *TINY)
    assert code == 2
    if "needs image inputs" in line:  # a family of models for larger images than digits' 8x8
        assert family in ("htfe-img-2", "htfe-img-4", "htfe-img-8", "htfe-img-8-htc-img-4")
        return
    from protofl.config import ModelConfig
    digits = load_dataset(DataConfig(name="digits", num_clients=3), lean=True)
    with torch.device("meta"):
        groups, _ = build_groups(ModelConfig(family=family, feature_dim=d),
                                 digits.input_shape, digits.num_classes)
    models = sum(p.numel() * 4 for m in groups.models for p in m.parameters())
    if 5 * models > 16 << 30:
        assert f"model.feature_dim = {d}" in line and "bytes" in line, line
        assert "16.0 GiB of memory" in line
    if family == "htfe-cnn":  # measured: d = 10^5 runs in 3.2 GB, 10^6 took over 14 GB
        assert (line == "protofl: error: sized: fits") == (d == 10**5), line
    assert not (tmp_path / "run").exists()


def test_the_estimate_is_a_lower_bound_of_what_a_run_holds(tmp_path):
    """The guard's bytes of a small heterogeneous run against the high-water mark of a real
    one (a child process, so nothing else's memory counts): at most what it held, and more
    than half of it (before issue 50 it counted under a third: no client's own model, no
    group's initial weights in the state, no checkpoint copies, no features)."""
    import subprocess
    import sys

    script = f"""
import gc
from protofl import sizes
from protofl.config import config_from_dict
from protofl.data.registry import load_dataset
from protofl.engine import hetero
from protofl.engine.experiment import Experiment
from protofl.engine.runfolder import RunStore
from protofl.engine.spec import meta_algorithm, resolve, resolve_data

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) << 10

cfg = config_from_dict({{"algorithm": "fedproto", "rounds": 1, "trainer": "sequential",
    "threads": 1, "data": {{"name": "digits", "num_clients": 3}},
    "clients": {{"per_round": 2, "local_steps": 1, "batch_size": 8}},
    "model": {{"family": "htfe-cnn", "feature_dim": 20000}},
    "metrics": {{"dissimilarity_clients": 0, "train_loss_samples": 20}}}})
data = load_dataset(resolve_data(cfg.data), lean=True)
spec = resolve(cfg, data)
alg, _ = meta_algorithm(spec, data)
estimate = sum(n.nbytes for n in sizes.run_needs(spec, data, data, alg, None,
                                                 hetero.init_state))
gc.collect()
base = status("VmRSS")
Experiment(cfg, store=RunStore({str(tmp_path / "run")!r})).run()
print(estimate, status("VmHWM") - base)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PROTOFL_MEMORY_MB": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    estimate, held = map(int, done.stdout.split())
    assert 0.5 * held < estimate <= held, (estimate, held)


def test_on_cuda_what_lives_on_the_device_is_checked_against_its_free_memory(monkeypatch):
    from protofl import device as devices
    from protofl import sizes

    monkeypatch.setattr(devices, "memory_info",  # a CUDA device with 1 MiB free
                        lambda d: (1 << 20, 80 << 30) if str(d).startswith("cuda") else None)
    monkeypatch.setenv(sizes.MEMORY_ENV, "5.5")  # and 5.5 MiB of host memory
    model = sizes.Need("model.feature_dim", 9, 2 << 20, "the model", device=True)
    schedule = sizes.Need("clients.local_steps", 9, 3 << 20, "a schedule")
    sizes.check([model, schedule])  # a CPU run: 5 MiB of host memory, both fit
    with pytest.raises(ProtoflError, match="local_steps = 9: a schedule would take 3.0 MiB"):
        sizes.check([model, schedule, sizes.Need("x", 1, 1 << 20, "more")])
    sizes.check([schedule], "cuda:0")  # the host holds the schedule: fits
    with pytest.raises(ProtoflError, match=r"model\.feature_dim = 9: the model would take "
                                           r"2\.0 MiB .* the 1\.0 MiB of memory cuda:0 has"):
        sizes.check([model, schedule], "cuda:0")


def integer_options() -> list[tuple[str, str]]:
    """(key, algorithm or "") of every integer option `protofl options` lists."""
    from protofl.doctables import options_markdown

    out, algorithm = [], ""
    for line in options_markdown().splitlines():
        if line.startswith("## "):
            found = re.search(r"of `(\w+)`", line)
            algorithm = found.group(1) if found else ""
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`") and "an integer" in cells[2]:
            out.append((cells[0].strip("`"), algorithm))
    return out


# where an option matters (the default: fedavg on TINY's three Synthetic clients)
WHERE = {
    "model.feature_dim": ["--dataset", "digits", "--algorithm", "fedproto", "--set",
                          "model.family=htfe-cnn"],
    "model.seg_channels": ["--dataset", "shapes", "--set", "data.image_size=16"],
    "data.image_size": ["--dataset", "shapes"],
    "clients.local_epochs": ["--set", "clients.local_steps=null"],
    "metrics.early_stop": ["--set", "data.validation_fraction=0.2"],
}
TIME_ONLY = {"algo.server_epochs"}  # a round's server epochs cost time, never memory
EXTREMES = [0, -1, 2**31, 10**12]
INTEGER_CASES = [(key, alg, v) for key, alg in integer_options() for v in EXTREMES]


def test_the_property_covers_every_integer_option():
    keys = {key for key, _ in integer_options()}
    assert {"rounds", "clients.local_steps", "model.feature_dim", "algo.max_global",
            "threads"} <= keys and len(keys) >= 30


@pytest.mark.parametrize("key, algorithm, value", INTEGER_CASES,
                         ids=[f"{k}={v}" for k, _, v in INTEGER_CASES])
def test_every_integer_option_at_an_extreme_is_refused_in_one_line_or_runs(
        tmp_path, capsys, monkeypatch, key, algorithm, value):
    """0, -1, 2^31 and 10^12 for every integer option: one line and exit 2, or a run (of one
    round at most) that ends; never a traceback, never the allocator's error, never a process
    that grows past 4 GiB more or runs past 20 s."""
    from protofl.config import config_from_dict
    from protofl.engine.federation import build
    from protofl.report.plots import PlotRun
    from protofl.report.stats import PartitionStats

    # the run folder's figures are not under test here (and cost a second a run)
    monkeypatch.setattr(PlotRun, "on_run_end", lambda *a: None)
    monkeypatch.setattr(PartitionStats, "on_run_start", lambda *a: None)
    args = ["run", "--out", str(tmp_path / "run"), *TINY, "--rounds", "1",
            "--set", "callbacks=[callbacks_example:StopAfterFirstRound]",
            *(["--algorithm", algorithm] if algorithm else []), *WHERE.get(key, []),
            "--set", f"{key}={value}"]
    with bounded(20):
        if key in TIME_ONLY and value > 0:  # sized and built, not run: it would take years
            raw: dict = {"algorithm": algorithm, "threads": 1,
                         "data": {"num_clients": 3}, "clients": {"per_round": 2}}
            apply_set(raw, f"{key}={value}")
            assert build(config_from_dict(raw)).spec.algo["server_epochs"] == value
            return
        code, line = cli(capsys, *args)
    assert code in (0, 2), line
    if code == 2:
        assert str(value) in line or "bytes" in line, line


def test_a_budget_in_mib_from_the_environment(monkeypatch):
    from protofl.engine import vectorized
    from protofl.sizes import env_mib

    monkeypatch.setenv("PROTOFL_X_MB", "1.5")
    assert env_mib("PROTOFL_X_MB") == 1_572_864 and env_mib("PROTOFL_UNSET_MB") is None
    monkeypatch.setenv(vectorized.BUDGET_ENV, "lots")
    with pytest.raises(ProtoflError, match="PROTOFL_VECTORIZED_BUDGET_MB = 'lots' is not a "
                                           "number of MiB"):
        vectorized.memory_budget()


# ---- issue 50, item 6: messages that misled ----

def test_fedgen_noise_dim_is_named_when_it_is_what_is_too_large(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PROTOFL_MEMORY_MB", AS_ON_16_GIB)
    code, line = cli(capsys, "run", "--algorithm", "fedgen", "--dataset", "digits",
                     "--set", "algo.noise_dim=2147483648", "--out", str(tmp_path / "run"), *TINY)
    assert code == 2 and "algo.noise_dim = 2147483648" in line, line
    assert "server_steps =" not in line and line.endswith("lower algo.noise_dim")
    code, line = cli(capsys, "run", "--algorithm", "fedgen", "--dataset", "digits",
                     "--set", "algo.server_steps=2147483648", "--out", str(tmp_path / "run"),
                     *TINY)
    assert code == 2 and "algo.server_steps = 2147483648" in line, line


def test_out_naming_a_folder_of_runs_says_so_and_leaves_it_untouched(finished, capsys):
    runs = finished.parent  # holds the run folder `fedavg`
    before = sorted(p.name for p in runs.iterdir())
    for extra in ([], ["--overwrite"]):
        code, line = cli(capsys, "run", "--rounds", "1", "--out", str(runs), *TINY, *extra)
        assert code == 2 and f"--out {runs} is a folder of runs (fedavg)" in line, line
        assert "stopped before its first checkpoint" not in line
        assert sorted(p.name for p in runs.iterdir()) == before  # no stray lock file


def test_out_naming_a_folder_of_other_files_says_so(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    code, line = cli(capsys, "run", "--rounds", "1", "--out", str(tmp_path), *TINY)
    assert code == 2 and "already holds files that are not a run (notes.txt)" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_resume_with_rounds_below_the_checkpoint_is_one_line_without_a_warning(finished,
                                                                                capsys):
    main(["run", "--resume", str(finished), "--rounds", "0", "-q"])
    err = capsys.readouterr().err
    assert err.strip() == (f"protofl: error: --rounds 0: {finished} has already run 1 round; "
                           "give at least 1"), err


@pytest.mark.parametrize("argv", [["run", "--rounds", "1", "--out", ""],
                                  ["compare", "runs", "--out", " "],
                                  ["suite", "main", "--out", ""]])
def test_an_empty_out_is_refused_not_replaced_by_the_default(tmp_path, capsys, monkeypatch,
                                                             argv):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    make_run(tmp_path / "runs" / "a")
    code, line = cli(capsys, *argv)
    assert code == 2 and "is empty: give a folder or file name" in line, line
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["a"]
