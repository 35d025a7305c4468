"""Segmentation end to end on the embedded Shapes set with a tiny DeepLab: the task option,
the algorithms that run it (and those refused), per-round mIoU and pixel accuracy, pixel
prototypes, seeded augmentation through resume, the run folder's figures, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from protofl.api import resume_experiment, run_experiment
from protofl.cli import main
from protofl.config import config_from_dict, merge
from protofl.engine.experiment import Experiment
from protofl.engine.parallel import ParallelTrainer
from protofl.errors import ProtoflError
from protofl.suites import plan

TINY = {"data": {"name": "shapes", "image_size": 16, "num_clients": 4, "max_samples": 80},
        "model": {"width": 0.25, "seg_channels": 8}, "rounds": 1, "checkpoint_every": 0,
        "clients": {"per_round": 2, "local_steps": 2, "batch_size": 4},
        "metrics": {"dissimilarity_clients": 2, "train_loss_samples": 20, "eval_batch": 16}}
SEG_ALGORITHMS = ("fedavg", "fedprox", "fedatt", "fedmargin", "central")


def tiny(algorithm: str = "fedmargin", **over) -> Experiment:
    return Experiment(config_from_dict(merge(TINY, {"algorithm": algorithm, **over})))


@pytest.mark.parametrize("algorithm", SEG_ALGORITHMS)
def test_segmentation_algorithms_log_miou(algorithm):
    exp = tiny(algorithm)
    assert exp.cfg.task == "segmentation" and exp.cfg.data.augment == "crop_flip"
    record = exp.step()
    for key in ("miou", "pixel_accuracy", "accuracy", "loss", "local_miou", "local_accuracy",
                "train_loss", "dissimilarity", "amm"):
        assert isinstance(record[key], float), key
    assert 0 <= record["miou"] <= 1 and record["accuracy"] == record["pixel_accuracy"]
    assert set(record["iou"]) == set(exp.data.class_names)
    assert len(record["confusion"]) == exp.data.num_classes
    assert set(record["client_miou"]) == set(record["client_accuracy"])


def test_exact_dissimilarity_runs_on_label_maps():
    """metrics.dissimilarity_exact (every row of every client) on masks gives a figure (it
    crashed: the per-pass row cap met max_per_client = None)."""
    exp = tiny("fedavg", metrics={**TINY["metrics"], "dissimilarity_exact": True})
    assert isinstance(exp.step()["dissimilarity"], float)


def test_fedmargin_uploads_pixel_prototypes():
    """P_k[c] is the mean of the feature vectors at the locations whose nearest-downsampled
    label is c (void dropped), computed here by hand from the encoder's map."""
    from protofl.algorithms.base import forward
    from protofl.engine.schedule import Job
    from protofl.engine.train import RoundContext

    exp = tiny("fedmargin")
    rc = RoundContext(exp.alg, exp.alg.broadcast(exp.state), [Job(0, 2)], exp.train_data,
                      exp.client_states, exp.setup, 1)
    [r] = exp.trainer.train(rc)
    x, y = exp.client_inputs(0)
    with torch.no_grad():
        z = forward(exp.alg.model, r.upload["params"], r.upload["buffers"], x)[0]
    small = y[:, ::4, ::4].long()  # 16 px labels -> the 4 x 4 feature map, nearest
    assert z.shape[-2:] == small.shape[-2:]
    for c in range(exp.data.num_classes):
        at = small == c
        assert r.upload["counts"][c] == at.sum()
        if at.any():
            assert torch.allclose(r.upload["protos"][c], z.permute(0, 2, 3, 1)[at].mean(0),
                                  atol=1e-5)
    assert r.upload["counts"].sum() == (small != 255).sum()


ABLATION = {f.split("/")[-2]: raw for raw, f in plan("fedmargin-ablation", Path("x"), (0,))}


@pytest.mark.parametrize("row", list(ABLATION))
def test_every_table3_row_runs_on_segmentation(row):
    raw = merge(ABLATION[row], {**TINY, "algorithm": "fedmargin",
                                "metrics": {**TINY["metrics"], "dissimilarity_clients": 0}})
    exp = Experiment(config_from_dict(raw))
    record = exp.step()
    assert abs(sum(record["weights"]) - 1) < 1e-9 and isinstance(record["amm"], float)


@pytest.mark.parametrize("algorithm", ["moon", "fedproin", "fedproto", "fedtgp", "fedplvm"])
def test_classification_only_algorithms_are_refused(algorithm):
    with pytest.raises(ProtoflError, match="supports classification only"):
        tiny(algorithm)


@pytest.mark.parametrize("over, needle", [
    ({"task": "classification"}, "task = classification but dataset 'shapes'"),
    ({"data": {"name": "digits"}, "task": "segmentation"}, "segmentation datasets: voc_seg"),
    ({"model": {"seg_channels": 12}}, "model.seg_channels = 12"),
    ({"data": {"name": "digits"}, "model": {"width": 0.5}}, "applies to deeplabv3plus only"),
])
def test_task_and_model_keys_are_checked(over, needle):
    raw = merge(TINY, over)
    if over.get("data", {}).get("name") == "digits":
        raw = {k: v for k, v in raw.items() if k != "data"} | {"data": over["data"]}
        raw["model"] = over.get("model", {})
    with pytest.raises(ProtoflError, match=needle):
        Experiment(config_from_dict(raw))


def test_crop_flip_needs_images():
    raw = {k: v for k, v in TINY.items() if k not in ("data", "model")}
    raw["data"] = {"name": "synthetic", "augment": "crop_flip"}  # vector rows
    with pytest.raises(ProtoflError, match="data.augment = crop_flip needs images"):
        Experiment(config_from_dict(raw))


def test_model_keys_resolve_from_the_dataset():
    exp = Experiment(config_from_dict({**{k: v for k, v in TINY.items() if k != "model"},
                                       "algorithm": "fedavg"}))
    assert (exp.cfg.model.width, exp.cfg.model.output_stride, exp.cfg.model.seg_channels) == (
        0.5, 16, 64)
    assert exp.alg.model.feature_dim == 64
    assert tiny("fedavg", model={"width": 0.25, "seg_channels": 16, "output_stride": 8}
                ).alg.model.feature_dim == 16


def test_augmentation_switch_changes_batches_not_the_data():
    on, off = tiny("fedavg"), tiny("fedavg", data={**TINY["data"], "augment": "none"})
    assert off.setup.augment is None and on.setup.augment is not None
    a, b = on.step(), off.step()
    assert a["client_loss"] != b["client_loss"] and torch.equal(on.data.y_test, off.data.y_test)


def test_resume_equals_uninterrupted(tmp_path):
    cfg = config_from_dict(merge(TINY, {"algorithm": "fedmargin", "rounds": 2,
                                        "checkpoint_every": 1}))
    full = run_experiment(cfg, tmp_path / "full")
    run_experiment(config_from_dict(merge(TINY, {"algorithm": "fedmargin", "rounds": 1,
                                                 "checkpoint_every": 1})), tmp_path / "part")
    resumed = resume_experiment(tmp_path / "part", rounds=2)
    for key in ("miou", "accuracy", "loss", "amm", "local_miou"):
        assert resumed[key] == full[key], key


def test_cli_run_folder_figures_compare_and_tsne(tmp_path, capsys):
    sets = ["--set", "data.image_size=16", "--set", "data.num_clients=4", "--set",
            "data.max_samples=80", "--set", "model.width=0.25", "--set", "model.seg_channels=8",
            "--set", "clients.per_round=2", "--set", "clients.local_steps=2", "--set",
            "metrics.dissimilarity_clients=0", "--set", "metrics.train_loss_samples=0"]
    runs = tmp_path / "runs"
    for alg in ("fedavg", "fedmargin", "central"):
        assert main(["run", "--task", "segmentation", "--algorithm", alg, "--rounds", "1", "-q",
                     "--out", str(runs / alg), *sets]) == 0
    out = capsys.readouterr().out
    assert "on shapes" in out and "miou" in out
    cfg = json.loads((runs / "fedavg" / "config.json").read_text())
    assert cfg["task"] == "segmentation" and cfg["data"]["name"] == "shapes"
    for alg in ("fedavg", "fedmargin", "central"):
        assert (runs / alg / "segmentation.png").stat().st_size > 1000
    assert main(["compare", str(runs)]) == 0
    table = capsys.readouterr().out
    assert "| mIoU | pixel accuracy |" in table and "local mIoU" in table
    assert "Pearson rho(final AMM, mIoU)" in table
    fig = tmp_path / "qual.png"
    assert main(["segfigure", str(runs / "fedavg"), str(runs / "fedmargin"),
                 str(runs / "central"), "--out", str(fig), "--images", "2"]) == 0
    assert fig.stat().st_size > 1000
    assert main(["segfigure", str(runs / "fedavg"), "--out", str(fig)]) == 2
    assert main(["segfigure", str(runs / "fedavg"), "--out",  # never into a run folder
                 str(runs / "fedavg" / "qual.png")]) == 2
    assert main(["tsne", str(runs / "fedmargin"), "--samples", "60"]) == 0
    assert (runs / "fedmargin" / "tsne.png").exists()
    assert main(["run", "--task", "segmentation", "--algorithm", "moon", "-q"]) == 2
    assert "supports classification only" in capsys.readouterr().err


def test_loss_is_the_image_mean_of_pixel_cross_entropy():
    exp = tiny("fedavg")
    x, y = exp.client_inputs(1)
    w = exp.alg.global_weights(exp.state)
    from protofl.algorithms.base import forward

    logits = forward(exp.alg.model, w["params"], w["buffers"], x[:3])[1]
    got = exp.alg.loss(exp.alg.model, w["params"], w["buffers"], x[:3], y[:3],
                       torch.ones(3), {})
    per_image = [F.cross_entropy(logits[i:i + 1], y[i:i + 1].long(), ignore_index=255)
                 for i in range(3)]
    assert torch.allclose(got, torch.stack(per_image).mean(), atol=1e-6)


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_parallel_trainer_gives_the_sequential_numbers_with_augmentation(start, no_lead):
    """The data-level crop/flip travels to the parallel trainer's workers (pickled with the
    setup) and draws the sequential trainer's batches and crops; spawned workers get the
    rows' standardisation with the shared rows (no lead client: bit for bit)."""
    want = tiny(trainer="sequential").run()
    exp = tiny(trainer="parallel", workers=2)
    exp.trainer = ParallelTrainer(2, "sequential", start=start)
    got = exp.run()
    drop = ("seconds", "trainer")
    assert {k: v for k, v in got.items() if k not in drop} == {
        k: v for k, v in want.items() if k not in drop}


def test_the_api_takes_task_segmentation_alone_as_the_cli_does():
    """``protofl.run({"task": "segmentation"})`` runs on the task's default dataset, as
    ``protofl run --task segmentation`` does (one rule: ``data.registry.with_task_dataset``)."""
    from protofl.api import as_config

    cfg = as_config({"task": "segmentation"})
    assert cfg.task == "segmentation" and cfg.data.name == "shapes"
    assert as_config({"task": "segmentation", "data": {"name": "voc_seg"}}).data.name == "voc_seg"
    assert as_config({"task": "classification"}).data.name == "synthetic"
