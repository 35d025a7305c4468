"""Devices and precision: the config and CLI refuse what is not there; on a (simulated)
accelerator every algorithm, both trainers and all metrics keep their tensors on the device
and compute what the CPU computes; checkpoints and client states stay on the CPU; mixed
precision trains (fp16 through a loss scaler). CUDA itself is exercised by test_gpu.py on a
machine that has it."""

from __future__ import annotations

import logging

import pytest
import torch
from fakedevice import OnDevice, on_device, on_host, simulated

from protofl import device as devices
from protofl.algorithms.registry import ALGORITHMS
from protofl.api import run_experiment
from protofl.cli import main
from protofl.config import config_from_dict
from protofl.engine import vectorized
from protofl.engine.experiment import Experiment
from protofl.errors import ProtoflError

FAST = {"fedtgp": {"server_epochs": 3}}  # the server's prototype training, shortened


def tiny(algorithm: str, trainer: str, **over) -> dict:
    """Two rounds on digits (4 clients, 2 a round, 2 local steps), every metric on."""
    raw = {"algorithm": algorithm, "rounds": 2, "checkpoint_every": 0, "trainer": trainer,
           "data": {"name": "digits", "num_clients": 4},
           "clients": {"per_round": 2, "local_steps": 2},
           "metrics": {"dissimilarity_clients": 2, "dissimilarity_rows": 20,
                       "train_loss_samples": 50},
           "algo": FAST.get(algorithm, {})}
    for k, v in over.items():
        raw[k] = {**raw[k], **v} if isinstance(v, dict) else v
    return raw


SEG_TINY = {"rounds": 2, "checkpoint_every": 0,
            "data": {"name": "shapes", "image_size": 16, "num_clients": 4, "max_samples": 80},
            "model": {"width": 0.25, "seg_channels": 8},
            "clients": {"per_round": 2, "local_steps": 2, "batch_size": 4},
            "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 20, "eval_batch": 16,
                        "every": 1}}


def figures(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in ("seconds", "device")}


def test_devices_are_resolved_or_refused():
    assert devices.resolve("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert devices.resolve("auto") == torch.device("cpu")
        with pytest.raises(ProtoflError, match="no CUDA device"):
            devices.resolve("cuda:0")
    with pytest.raises(ProtoflError, match="allowed: auto, cpu, cuda, cuda:N or mps"):
        devices.resolve("gpu")
    with pytest.raises(ProtoflError, match="device = 'gpu' is out of range"):
        config_from_dict({"device": "gpu"})
    with pytest.raises(ProtoflError, match="precision"):
        config_from_dict({"precision": "fp8"})
    assert config_from_dict({"device": "cuda:1"}).device == "cuda:1"
    assert config_from_dict({"workers": "auto"}).workers is None


def test_cli_refuses_a_missing_device_in_one_line(capsys):
    bad = "gpu" if torch.cuda.is_available() else "cuda"
    assert main(["run", "--rounds", "1", "--device", bad, "--out", "unused", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("protofl: error: config: device") and "\n" not in err


def test_host_helpers_do_not_copy_on_the_cpu():
    x = torch.arange(6).reshape(2, 3)
    tree = {"a": x, "b": [x, 1]}
    assert devices.to_host(tree)["a"] is x and devices.to_device(tree, "cpu")["b"][0] is x
    assert devices.upload(x, "cpu") is x
    assert devices.wide("cpu") == torch.float64 and devices.free_memory("cpu") is None


def test_the_chunk_budget_follows_free_cuda_memory(monkeypatch):
    monkeypatch.delenv(vectorized.BUDGET_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000 << 20, 4000 << 20))
    assert vectorized.memory_budget("cuda:0") == int(devices.FREE_SHARE * (1000 << 20))
    assert vectorized.memory_budget("cpu") == vectorized.DEFAULT_BUDGET
    monkeypatch.setenv(vectorized.BUDGET_ENV, "3")
    assert vectorized.memory_budget("cuda:0") == 3 << 20


def test_the_simulated_device_refuses_what_cuda_refuses():
    with simulated() as dev:
        a = torch.ones(3).to(dev)
        assert isinstance(a, OnDevice) and a.device == dev
        assert (a + torch.tensor(2.0)).tolist() == [3.0, 3.0, 3.0]  # a CPU scalar is fine
        assert a[torch.tensor([0, 2])].sum().item() == 2.0  # CPU indices are fine
        with pytest.raises(RuntimeError, match="same device"):
            a + torch.ones(3)
        with pytest.raises(RuntimeError, match="indexed with device"):
            torch.ones(3)[torch.tensor([0]).to(dev)]
        with pytest.raises(RuntimeError, match="generator"):
            torch.randperm(3, generator=torch.Generator(), device=dev)
        with pytest.raises(TypeError):
            a.numpy()


@pytest.mark.parametrize("trainer", ["sequential", "vectorized"])
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_runs_on_a_device_as_on_the_cpu(monkeypatch, name, trainer):
    """Two rounds on the simulated accelerator give the CPU's figures exactly (it computes on
    the CPU), with the server state on the device and the checkpoint on the host."""
    raw = tiny(name, trainer)
    if name == "fedavg":  # the exact dissimilarity too (every client, every row)
        raw["metrics"] = {**raw["metrics"], "dissimilarity_exact": True}
    want = Experiment(config_from_dict(raw)).run()
    monkeypatch.setattr(devices, "resolve", lambda _: torch.device("meta"))
    with simulated():
        exp = Experiment(config_from_dict(raw))
        got = exp.run()
        snapshot = exp.snapshot()
    assert figures(got) == figures(want)
    assert got["device"] == "meta" and exp.setup.device == "meta"
    assert on_device(exp.state) and on_host(snapshot) and on_host(exp.client_states)
    if name in ("fedavg", "fedproto"):
        assert "dissimilarity" in got or exp.alg.global_weights(exp.state) is None


def test_bf16_trains_with_both_trainers_close_to_fp32(monkeypatch):
    entered = []
    real = devices.autocast

    def counted(device, precision):
        entered.append(precision)
        return real(device, precision)

    monkeypatch.setattr(devices, "autocast", counted)
    fp32 = Experiment(config_from_dict(tiny("fedproin", "sequential"))).run()
    assert set(entered) == {"fp32"}
    for trainer in ("sequential", "vectorized"):
        entered.clear()
        got = Experiment(config_from_dict(tiny("fedproin", trainer, precision="bf16"))).run()
        assert entered and set(entered) == {"bf16"}  # training and evaluation under bf16
        assert got["loss"] == pytest.approx(fp32["loss"], abs=0.05)
        assert got["client_loss"] == pytest.approx(fp32["client_loss"], abs=0.05)


def test_fp16_scales_the_loss_and_vectorized_falls_back(monkeypatch, caplog):
    steps = []
    real = torch.amp.GradScaler.step

    def counted(self, optimizer, *args, **kwargs):
        steps.append(self.get_scale())
        return real(self, optimizer, *args, **kwargs)

    monkeypatch.setattr(torch.amp.GradScaler, "step", counted)
    monkeypatch.setattr(vectorized, "_logged", set())
    seq = Experiment(config_from_dict(tiny("fedavg", "sequential", precision="fp16"))).run()
    assert len(steps) == 2 * 2 * 2 and steps[0] == 65536.0  # rounds x clients x steps
    with caplog.at_level(logging.INFO, logger="protofl"):
        vec = Experiment(config_from_dict(tiny("fedavg", "vectorized", precision="fp16"))).run()
    assert any("GradScaler" in r.getMessage() for r in caplog.records)
    assert figures(vec) == figures(seq)  # trained, and reported, as sequential


@pytest.mark.parametrize("trainer", ["sequential", "vectorized"])
def test_a_device_without_float64_keeps_the_server_on_the_cpu(monkeypatch, trainer):
    """MPS has no float64: the server state and aggregation stay on the CPU and the trainers
    accumulate in float32 (sequential: the CPU's figures; vectorized: float32 step counts in
    Adam's bias correction, so close ones)."""
    raw = tiny("fedmargin", trainer, clients={"optimizer": "adam", "lr": 0.01},
               metrics={"dissimilarity_clients": 0})
    want = Experiment(config_from_dict(raw)).run()
    monkeypatch.setattr(devices, "resolve", lambda _: torch.device("meta"))
    monkeypatch.setattr(devices, "has_float64", lambda d: torch.device(d).type != "meta")
    with simulated(float64=False):
        exp = Experiment(config_from_dict(raw))
        got = exp.run()
    assert on_host(exp.state) and exp.server == torch.device("cpu")
    for key in ("accuracy", "loss", "client_loss", "train_loss", "amm"):
        assert got[key] == pytest.approx(want[key], rel=0 if trainer == "sequential" else 1e-3)


def test_resume_takes_a_device(tmp_path, capsys):
    """Checkpoints hold CPU tensors, so a run goes on on another device; --device is the one
    flag --resume takes besides --rounds (a bad one is still one line)."""
    out = tmp_path / "run"
    common = ["--set", "data.num_clients=4", "--set", "clients.per_round=2",
              "--set", "clients.local_steps=1", "--set", "metrics.dissimilarity_clients=0"]
    assert main(["run", "-q", "--dataset", "digits", "--rounds", "1", "--out", str(out),
                 "--device", "cpu", *common]) == 0
    assert main(["run", "-q", "--resume", str(out), "--rounds", "2", "--device", "cpu"]) == 0
    capsys.readouterr()
    assert main(["run", "-q", "--resume", str(out), "--rounds", "3", "--device", "tpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "tpu" in err and "\n" not in err  # still one line


@pytest.mark.parametrize("name", ["fedavg", "fedmargin"])
def test_segmentation_runs_on_a_device_as_on_the_cpu(monkeypatch, name):
    """Segmentation (pixel prototypes, the data's standardisation and crop/flip, mIoU,
    per-image losses) on the simulated accelerator gives the CPU's figures. Sequential only,
    without the dissimilarity probe: ``vmap`` over DeepLab fails on shapes inside the
    simulator's dispatch (not on the CPU); ``tests/test_gpu.py`` runs both on a real GPU."""
    raw = SEG_TINY | {"algorithm": name, "trainer": "sequential"}
    want = Experiment(config_from_dict(raw)).run()
    monkeypatch.setattr(devices, "resolve", lambda _: torch.device("meta"))
    with simulated():
        exp = Experiment(config_from_dict(raw))
        got = exp.run()
    assert figures(got) == figures(want) and "miou" in got and "amm" in got
    assert on_device(exp.state)


def test_ffd_runs_on_a_device_as_on_the_cpu(monkeypatch, tmp_path):
    """``mmd`` against a central reference (its model on the CPU) from client models on the
    simulated accelerator equals the CPU's."""
    run_experiment(config_from_dict(tiny("central", "sequential")), tmp_path / "central")
    raw = tiny("fedavg", "sequential", metrics={"ffd_reference": str(tmp_path / "central")})
    want = Experiment(config_from_dict(raw)).run()
    monkeypatch.setattr(devices, "resolve", lambda _: torch.device("meta"))
    with simulated():
        got = Experiment(config_from_dict(raw)).run()
    assert "mmd" in got and got["mmd"] == want["mmd"]


@pytest.mark.parametrize("algorithm, privacy", [
    ("fedavg", {"noise_multiplier": 1.0, "reproducible_noise": True}),
    ("fedavg", {"noise_multiplier": 1.0, "noise": "client", "reproducible_noise": True}),
    ("fedavg", {"secagg": True})])
def test_private_rounds_run_on_a_device_as_on_the_cpu(monkeypatch, algorithm, privacy):
    """Server and client noise (drawn on the CPU from the same generators) and simulated
    secure sums give the CPU's figures on the simulated accelerator."""
    raw = {**tiny(algorithm, "sequential"), "privacy": privacy}
    want = Experiment(config_from_dict(raw)).run()
    monkeypatch.setattr(devices, "resolve", lambda _: torch.device("meta"))
    with simulated():
        exp = Experiment(config_from_dict(raw))
        got = exp.run()
    assert figures(got) == figures(want) and on_device(exp.state)
