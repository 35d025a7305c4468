"""configs/voc.yaml and configs/voc_macro.yaml are valid for users with the data: they parse
and build the run (data, DeepLab, algorithm) on a tiny VOCdevkit tree in the real layout."""

import pytest
import torch
from test_loaders_voc_seg import make_mask
from voctree import write_tree

from protofl.config import config_from_dict, load_raw
from protofl.engine.experiment import Experiment

TRAIN, VAL = 60, 4  # the configs ask for 50 clients


def write_voc_tree(root):
    masks = {"train": {}, "val": {}}
    for n in range(TRAIN + VAL):
        masks["train" if n < TRAIN else "val"][f"2008_{n:06d}"] = make_mask([1 + n % 20])
    write_tree(root, masks)
    return root


@pytest.mark.parametrize("name, classes", [("voc", 21), ("voc_macro", 5)])
def test_voc_configs_build_on_a_tiny_tree(tmp_path, name, classes):
    raw = load_raw(f"configs/{name}.yaml")
    raw["data"]["root"] = str(write_voc_tree(tmp_path))
    exp = Experiment(config_from_dict(raw))
    cfg = exp.cfg
    assert cfg.task == "segmentation" and cfg.data.augment == "crop_flip"
    assert exp.data.num_classes == classes and exp.data.num_clients == 50
    assert exp.data.input_shape == (3, 256, 256) and exp.data.x_train.dtype == torch.uint8
    assert (cfg.model.name, cfg.model.width, cfg.model.output_stride, cfg.model.seg_channels) \
        == ("deeplabv3plus", 1.0, 16, 256)
    assert exp.alg.name == "fedmargin" and exp.alg.model.feature_dim == 256
