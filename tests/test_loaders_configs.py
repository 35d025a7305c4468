"""Every config file in configs/ loads, names a known dataset and model, and says which data
files data.root must hold."""

from pathlib import Path

import pytest

from protofl.config import config_from_dict, load_raw
from protofl.data.registry import DATASETS
from protofl.models.registry import MODELS

# these say what data.root holds
DOCUMENTED = {"mnist", "femnist", "celeba", "ham10000", "matek19", "voc", "voc_macro",
              "fashion_mnist", "fashion_mnist_short"}
CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.y*ml"))


def test_there_are_configs():
    assert DOCUMENTED <= {p.stem for p in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads(path):
    cfg = config_from_dict(load_raw(path))
    assert cfg.data.name in DATASETS
    assert cfg.model.name == "auto" or cfg.model.name in MODELS
    if path.stem in DOCUMENTED:
        assert "data.root must hold" in path.read_text()
