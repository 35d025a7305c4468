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
