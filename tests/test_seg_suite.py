"""``protofl suite segmentation``: its plan (3 splits x fedavg, fedmargin, 3 seeds; the
centralized reference once per seed) and, on a tiny version, everything it writes."""

import dataclasses
import json
from pathlib import Path

from protofl import suites
from protofl.algorithms.registry import algorithm_class
from protofl.config import config_from_dict, merge
from protofl.engine.spec import fill
from protofl.suites import SUITES, plan, run_suite

TINY = {"data": {"image_size": 16, "num_clients": 4, "max_samples": 60},
        "model": {"width": 0.25, "seg_channels": 8}, "rounds": 1, "eval_every": 1,
        "clients": {"per_round": 2, "local_steps": 1, "batch_size": 4},
        "metrics": {"train_loss_samples": 10, "eval_batch": 32}}


def test_plan():
    jobs = plan("segmentation", Path("out"))
    folders = [f for _, f in jobs]
    assert len(jobs) == 30  # 3 splits x (fedavg, fedavg-size-sampled, fedmargin) x 3 seeds + 3
    for a in ("0.01", "0.1", "1"):
        for alg in ("fedavg", "fedmargin", "fedavg-size-sampled"):
            assert all(f"out/shapes-a{a}/{alg}/seed{s}" in folders for s in range(3))
    assert [f for f in folders if "central" in f] == [
        f"out/shapes-a1/central/seed{s}" for s in range(3)]
    for raw, folder in jobs:
        cfg = config_from_dict(raw)
        c = fill(cfg.clients, algorithm_class(cfg.algorithm).client_defaults)
        # each method its own sampling: FedAvg uniform (but the labelled row), fedmargin ∝ n_k
        size_sampled = cfg.algorithm == "fedmargin" or folder.split("/")[2].endswith(
            "size-sampled")
        assert c.sampling == ("weighted" if size_sampled else "uniform"), folder
        assert cfg.data.name == "shapes" and cfg.data.seed == cfg.seed  # partition per seed
        assert cfg.data.alpha == float(folder.split("/")[1].removeprefix("shapes-a"))


def test_tiny_suite_writes_table_figures_and_report(tmp_path, monkeypatch):
    full = SUITES["segmentation"]
    small = dataclasses.replace(
        full, datasets={k: merge(v, TINY) for k, v in full.datasets.items()
                        if k in ("shapes-a0.1", "shapes-a1")}, seeds=(0,))
    monkeypatch.setitem(suites.SUITES, "segmentation", small)
    text = run_suite("segmentation", tmp_path, jobs=1)
    assert "| mIoU | pixel accuracy |" in text and "shapes (dirichlet_powerlaw α=0.1)" in text
    for name in ("table.md", "report.html", "partition.png", "qualitative_shapes-a0.1.png",
                 "qualitative_shapes-a1.png"):
        assert (tmp_path / name).stat().st_size > 500, name
    assert "qualitative_shapes-a0.1.png" in text
    stats = json.loads((tmp_path / "shapes-a0.1" / "fedavg" / "seed0" / "stats.json").read_text())
    assert stats["clients"] == 4
    html = (tmp_path / "report.html").read_text()
    assert "mIoU" in html and "segmentation" in html
    # a second call finds every run finished and only redraws
    assert run_suite("segmentation", tmp_path, jobs=1) == text
