"""The Shapes-pretrained encoder: a torchvision-style state_dict with real BatchNorm
statistics that model.pretrained reads, reused when its record matches."""

from __future__ import annotations

import json

import pytest
import torch

from protofl.config import ModelConfig
from protofl.errors import ProtoflError
from protofl.models import pretrain as P
from protofl.models.deeplab import deeplabv3plus

TINY = P.PretrainSpec(width=0.35, size=16, images=40, steps=3, batch=8)


@pytest.mark.parametrize("objective", P.OBJECTIVES)
def test_pretrained_encoder_loads_with_its_statistics(tmp_path, objective):
    spec = P.PretrainSpec(**{**TINY.__dict__, "objective": objective})
    path = P.shapes_encoder(tmp_path / "enc.pth", spec, log=lambda *_: None)
    sd = torch.load(path, weights_only=True)
    assert "features.0.0.weight" in sd and "features.17.conv.3.running_var" in sd
    assert not torch.equal(sd["features.0.1.running_mean"], torch.zeros_like(
        sd["features.0.1.running_mean"]))  # trained in training mode: statistics moved
    m = deeplabv3plus((3, 16, 16), 9, ModelConfig(norm="frozen", pretrained=str(path)),
                      width=0.35, channels=16)
    assert torch.equal(m.encoder.features[2].conv[1][1].running_var,
                       sd["features.2.conv.1.1.running_var"])
    record = json.loads((tmp_path / "enc.pth.json").read_text())
    assert record["spec"]["objective"] == objective and record["spec"]["steps"] == 3


def test_shapes_encoder_is_reused_only_for_the_same_spec(tmp_path, monkeypatch):
    path = P.shapes_encoder(tmp_path / "enc.pth", TINY, log=lambda *_: None)
    first = torch.load(path, weights_only=True)

    def refuse(*_):
        raise AssertionError("retrained")

    monkeypatch.setattr(P, "pretrain", refuse)
    assert P.shapes_encoder(path, TINY) == path  # same spec: the file is reused
    monkeypatch.undo()
    P.shapes_encoder(path, P.PretrainSpec(**{**TINY.__dict__, "seed": 1}), log=lambda *_: None)
    again = torch.load(path, weights_only=True)
    assert not torch.equal(first["features.0.0.weight"], again["features.0.0.weight"])
    # deterministic: the same spec gives the same weights
    P.shapes_encoder(path, TINY, log=lambda *_: None)
    assert torch.equal(torch.load(path, weights_only=True)["features.5.conv.2.weight"],
                       first["features.5.conv.2.weight"])
    with pytest.raises(ProtoflError, match="objective"):
        P.pretrain(P.PretrainSpec(objective="nope"))


@pytest.mark.parametrize("trainer", ["vectorized", "sequential"])
def test_federated_run_keeps_the_frozen_statistics(tmp_path, trainer):
    """A fedmargin round on shapes from the pretrained encoder with norm = frozen: the
    vectorized trainer takes it (no BatchNorm module), and the final model's statistics are
    the pretrained ones (averaging identical buffers moves them by rounding only) while the
    affine weights trained."""
    from protofl.config import config_from_dict
    from protofl.engine.experiment import Experiment
    from protofl.engine.vectorized import vectorize_reason

    spec = P.PretrainSpec(**{**TINY.__dict__, "width": 0.25})
    path = P.shapes_encoder(tmp_path / "enc.pth", spec, log=lambda *_: None)
    sd = torch.load(path, weights_only=True)
    cfg = {"algorithm": "fedmargin", "trainer": trainer, "rounds": 2, "checkpoint_every": 0,
           "data": {"name": "shapes", "image_size": 16, "num_clients": 4, "max_samples": 80},
           "model": {"width": 0.25, "seg_channels": 8, "norm": "frozen",
                     "pretrained": str(path)},
           "clients": {"per_round": 2, "local_steps": 2, "batch_size": 4},
           "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 20, "eval_batch": 16}}
    exp = Experiment(config_from_dict(cfg))
    assert vectorize_reason(exp.alg.model) is None
    for _ in range(2):
        assert 0 <= exp.step()["miou"] <= 1
    buffers = exp.state["buffers"]
    key = "encoder.features.3.conv.1.1.running_var"
    assert torch.allclose(buffers[key], sd[key.removeprefix("encoder.")], rtol=1e-5)
    w = exp.state["params"]["encoder.features.3.conv.1.1.weight"]
    assert not torch.allclose(w, sd["features.3.conv.1.1.weight"])
