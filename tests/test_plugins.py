"""Plugins: every kind named by an import path, an installed entry point or (from Python)
the object itself; recorded in config.json with its package and version; a missing plugin
or one of another version stops resume and Flower nodes with one line naming its package."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import protofl
from protofl import plugins
from protofl.api import resume_experiment, run_experiment
from protofl.cli import main
from protofl.config import config_from_dict
from protofl.errors import ProtoflError

TINY = {"rounds": 2, "trainer": "sequential", "checkpoint_every": 1,
        "data": {"name": "digits", "num_clients": 4},
        "clients": {"per_round": 2, "local_steps": 1, "batch_size": 16},
        "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 0, "every": 0}}

PLUGIN = '''
from dataclasses import dataclass
import numpy as np
import torch
from protofl import DatasetSpec, option
from protofl.algorithms.fedavg import FedAvg
from protofl.data.digits import digits_federation
from protofl.engine.callbacks import Callback
from protofl.engine.train import SequentialTrainer
from protofl.models.nets import Mlp


class UniformAvg(FedAvg):
    name = "uniformavg"
    description = "every client weighted 1/K"

    def aggregation_weights(self, uploads, state):
        n = len(uploads)
        return torch.full((n,), 1.0 / n, dtype=torch.float64), {}


def tiny_mlp(in_shape, num_classes):
    return Mlp(int(np.prod(in_shape)), num_classes, hidden=(16,))


def halves(y, num_clients, rng, cfg):
    order = rng.permutation(len(y))
    return [np.sort(p) for p in np.array_split(order, num_clients)]


DIGITS = DatasetSpec(digits_federation, "", "digits, no model of its own", needs_files=False)


class Steady(SequentialTrainer):
    name = "steady"


class Count(Callback):
    def on_evaluate(self, view, record):
        record["counted"] = view.round
'''


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path holding module ``myplug`` and, once ``install(version)`` runs,
    an installed distribution ``myplug`` declaring its parts as entry points."""
    root = tmp_path / "site"
    (root / "myplug").mkdir(parents=True)
    (root / "myplug" / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", f"{root}:{Path(protofl.__file__).parents[1]}")

    def install(version: str = "1.0") -> None:
        info = root / "myplug-1.0.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: myplug\n"
                                       f"Version: {version}\n")
        (info / "top_level.txt").write_text("myplug\n")
        (info / "entry_points.txt").write_text(
            "[protofl.algorithms]\nuniformavg = myplug:UniformAvg\n"
            "[protofl.models]\ntinymlp = myplug:tiny_mlp\n"
            "[protofl.datasets]\nmydigits = myplug:DIGITS\n"
            "[protofl.partitions]\nhalves = myplug:halves\n"
            "[protofl.trainers]\nsteady = myplug:Steady\n"
            "[protofl.callbacks]\ncount = myplug:Count\n")

    yield install
    for name in [m for m in sys.modules if m == "myplug" or m.startswith("myplug.")]:
        del sys.modules[name]


def cfg(**over):
    return config_from_dict({**TINY, **over})


def test_every_kind_by_import_path(site, tmp_path):
    run_experiment(cfg(algorithm="myplug:UniformAvg", trainer="myplug:Steady",
                       callbacks=["myplug:Count"],
                       data={**TINY["data"], "name": "myplug:DIGITS", "partition": "myplug:halves"},
                       model={"name": "myplug:tiny_mlp"}), tmp_path / "r")
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["algorithm"] == "myplug:UniformAvg"
    assert set(config["plugins"]) == {"algorithm", "trainer", "callbacks[0]", "data.name",
                                      "data.partition", "model.name"}
    assert config["plugins"]["algorithm"] == {
        "kind": "algorithm", "path": "myplug:UniformAvg", "entry_point": None,
        "distribution": None, "version": None}
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["counted"] == 2 and rows[-1]["weights"] == [0.5, 0.5]
    assert resume_experiment(tmp_path / "r", rounds=3)["rounds"] == 3


def test_entry_points_are_listed_and_recorded_with_their_version(site, tmp_path, capsys):
    site("1.0")
    assert main(["algorithms"]) == 0
    assert "uniformavg" in capsys.readouterr().out
    assert main(["datasets"]) == 0
    assert "mydigits" in capsys.readouterr().out
    run_experiment(cfg(algorithm="uniformavg", trainer="steady", callbacks=["count"],
                       data={**TINY["data"], "name": "mydigits", "partition": "halves"},
                       model={"name": "tinymlp"}), tmp_path / "r")
    recorded = json.loads((tmp_path / "r" / "config.json").read_text())["plugins"]
    assert {r["distribution"] for r in recorded.values()} == {"myplug"}
    assert recorded["algorithm"]["entry_point"] == "uniformavg"
    assert recorded["algorithm"]["version"] == "1.0"
    site("2.0")  # upgraded between the run and its resume
    assert main(["run", "--resume", str(tmp_path / "r"), "--rounds", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "myplug 1.0" in err and "myplug 2.0 is installed" in err


def test_a_missing_plugin_is_one_line_naming_it(site, tmp_path, capsys):
    assert main(["run", "--algorithm", "nope.algos:Thing", "--rounds", "1"]) == 2
    assert "module 'nope' is not installed" in capsys.readouterr().err
    assert main(["run", "--algorithm", "myplug:Missing", "--rounds", "1"]) == 2
    assert "module 'myplug' has no 'Missing'" in capsys.readouterr().err
    assert main(["run", "--algorithm", "nonesuch", "--rounds", "1"]) == 2
    assert "or an import path package.module:Name" in capsys.readouterr().err
    recorded = {"algorithm": {"kind": "algorithm", "path": "gone:X", "entry_point": "gone",
                              "distribution": "gonepkg", "version": "3.1"}}
    with pytest.raises(ProtoflError, match=r"needs package gonepkg 3.1, which is not installed"):
        plugins.check(recorded)


def test_a_flower_node_runs_only_installed_plugins(site):
    path_only = {"algorithm": plugins.origin("algorithm", "myplug:UniformAvg", {})}
    plugins.check(path_only)  # the simulator imports it
    with pytest.raises(ProtoflError, match="this node runs only plugins installed on it"):
        plugins.check(path_only, installed_only=True)
    site("1.0")
    plugins.check({"algorithm": plugins.origin("algorithm", "uniformavg", {})},
                  installed_only=True)


def test_the_python_api_takes_the_objects_themselves(site):
    import myplug

    run = protofl.run({**TINY, "algorithm": myplug.UniformAvg, "trainer": myplug.Steady,
                       "data": {**TINY["data"], "name": myplug.DIGITS,
                                "partition": myplug.halves},
                       "model": {"name": myplug.tiny_mlp}})
    assert run.spec.algorithm == "myplug:UniformAvg"
    assert run.spec.data.name == "myplug:DIGITS" and run.spec.model.name == "myplug:tiny_mlp"
    assert run.records[-1]["weights"] == [0.5, 0.5]


def test_an_algorithm_of_another_contract_is_refused(site, capsys):
    import myplug

    Path(myplug.__file__).write_text(textwrap.dedent(PLUGIN) + "\nclass Old(UniformAvg):\n"
                                     "    contract = 1\n")
    del sys.modules["myplug"]
    assert main(["run", "--algorithm", "myplug:Old", "--rounds", "1"]) == 2
    assert "is written for hook contract 1; this protofl runs contract 2" in (
        capsys.readouterr().err)


def test_a_dataset_without_a_model_asks_for_one(site, capsys):
    assert main(["run", "--dataset", "myplug:DIGITS", "--rounds", "1"]) == 2
    assert "names no model of its own: set model.name" in capsys.readouterr().err


def test_python_m_protofl_is_the_command_line():
    done = subprocess.run([sys.executable, "-m", "protofl", "algorithms"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "fedmargin" in done.stdout
