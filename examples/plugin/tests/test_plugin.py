"""The example plugin, checked from outside protofl's source tree: the conformance kit on
each part, FedAvgM's server rule by hand, and the command line finding every part by name."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from protofl.algorithms.base import split_state
from protofl.testing import check_algorithm, check_dataset, check_model, check_partition

from protofl_example.fedavgm import FedAvgM
from protofl_example.models import residual_mlp


def test_fedavgm_keeps_the_contract():
    """Trainers, options, uploads, resume, privacy, memory guard and Flower, the run-level
    checks on this package's own dataset and model."""
    check_algorithm("fedavgm", config={"data": {"name": "wine", "num_clients": 4}})


def test_the_model_dataset_and_partition_keep_the_contract():
    check_model("resmlp", in_shape=(13,), num_classes=3)
    check_dataset("wine")
    check_partition("shards")


def test_fedavgm_server_rule_by_hand():
    """W = 1, clients at 0 (n = 1) and 2 (n = 3): the mean is 1.5, Delta = -0.5. Round 1:
    v = -0.5, W = 1 + 0.5 eta = 1.25 (eta 0.5). Round 2, clients at 0 and 0: Delta = 1.25,
    v = 0.9 (-0.5) + 1.25 = 0.8, W = 1.25 - 0.4 = 0.85."""
    model = residual_mlp((2,), 2)
    alg = FedAvgM({"momentum": 0.9, "server_lr": 0.5}, model, 2)
    state = alg.init_state(model)
    state["params"] = {k: torch.ones_like(v) for k, v in state["params"].items()}

    def upload(value, n):
        params, buffers = split_state(model)
        return {"params": {k: torch.full_like(v, value) for k, v in params.items()},
                "buffers": buffers, "num_samples": torch.tensor(float(n), dtype=torch.float64)}

    state, diag = alg.aggregate(state, [upload(0.0, 1), upload(2.0, 3)], 1)
    assert diag["weights"] == [0.25, 0.75]
    for v in state["params"].values():
        torch.testing.assert_close(v, torch.full_like(v, 1.25))
    state, _ = alg.aggregate(state, [upload(0.0, 1), upload(0.0, 1)], 2)
    for k, v in state["params"].items():
        torch.testing.assert_close(state["velocity"][k], torch.full_like(v, 0.8))
        torch.testing.assert_close(v, torch.full_like(v, 0.85))


def protofl(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "protofl", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=600)


def test_the_command_line_lists_and_runs_every_part_by_name(tmp_path):
    listed = protofl("algorithms").stdout
    assert "fedavgm" in listed and "(plugin: protofl-example-plugin 0.1.0)" in listed
    assert "wine" in protofl("datasets").stdout
    assert "## `algo.*` of `fedavgm`" in protofl("options").stdout
    out = tmp_path / "run"
    done = protofl("run", "--algorithm", "fedavgm", "--dataset", "wine", "--rounds", "2",
                   "--set", "data.partition=shards", "--set", "trainer=vectorized",
                   "--out", str(out))
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["plugins"]["algorithm"]["distribution"] == "protofl-example-plugin"
    assert config["plugins"]["data.partition"]["entry_point"] == "shards"
    assert config["model"]["name"] == "resmlp" and "model.name" in config["plugins"]
    again = protofl("run", "--resume", str(out), "--rounds", "3")
    assert again.returncode == 0, again.stderr
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("trainer", ["parallel"])
def test_it_trains_on_the_parallel_trainer(tmp_path, trainer):
    done = protofl("run", "--algorithm", "protofl_example.fedavgm:FedAvgM", "--dataset",
                   "digits", "--rounds", "2", "--set", f"trainer={trainer}", "--set",
                   "workers=2", "--out", str(tmp_path / "r"))
    assert done.returncode == 0, done.stderr


def test_a_suite_compares_it_with_the_baselines(tmp_path):
    done = protofl("suite", "main", "--with", "fedavgm", "--seeds", "0", "--rounds", "1",
                   "--set", "clients.local_steps=2", "--jobs", "2", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    table = (tmp_path / "table.md").read_text()
    assert "fedavgm" in table and "fedmargin" in table
    assert (tmp_path / "digits-noniid" / "fedavgm" / "seed0" / "summary.json").exists()
