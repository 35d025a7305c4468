"""Devices and precision: the config and CLI refuse what is not there; on a (simulated)
accelerator every algorithm, both trainers and all metrics keep their tensors on the device
and compute what the CPU computes; checkpoints and client states stay on the CPU; mixed
precision trains (fp16 through a loss scaler). CUDA itself is exercised by test_gpu.py on a
machine that has it."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from fakedevice import OnDevice, on_device, on_host, simulated

from protofl import device as devices
from protofl.algorithms import base, prototype_math
from protofl.algorithms.registry import ALGORITHMS
from protofl.api import run_experiment
from protofl.cli import main
from protofl.config import config_from_dict
from protofl.engine import vectorized
from protofl.engine.experiment import Experiment
from protofl.errors import ProtoflError
from protofl.models.registry import build_model

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


def test_segmentation_runs_on_a_device_as_on_the_cpu(monkeypatch):
    """Segmentation with fedmargin (pixel prototypes, margins, the data's standardisation and
    crop/flip, mIoU, per-image losses) on the simulated accelerator gives the CPU's figures
    (fedavg's path is a subset of fedmargin's). Sequential only,
    without the dissimilarity probe: ``vmap`` over DeepLab fails on shapes inside the
    simulator's dispatch (not on the CPU); ``tests/test_gpu.py`` runs both on a real GPU."""
    raw = SEG_TINY | {"algorithm": "fedmargin", "trainer": "sequential"}
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


# ---- passes sized from the device's memory (device.forward_rows) ----

def test_rows_per_pass_is_what_the_free_share_holds(monkeypatch):
    monkeypatch.setattr(devices, "memory_info", lambda d: (1000, 4000) if "cuda" in str(d)
                        else None)
    assert devices.rows_per_pass("cuda:0", 100, 50) == 8  # 0.8 * 1000 // 100
    assert devices.rows_per_pass("cuda:0", 100, 5) == 5  # never above the default
    assert devices.rows_per_pass("cuda:0", 10_000, 50) == 1  # at least one row
    assert devices.rows_per_pass("cpu", 10_000, 50) == 50  # the CPU: unchanged


def test_activation_bytes_counts_every_module_output():
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
    # Linear (2 x 4 float32 = 32 bytes), ReLU (32) and the Sequential's own output (32)
    assert devices.activation_bytes(lambda: net(torch.ones(2, 3))) == 96


def test_the_probe_runs_once_per_model_and_row_shape(monkeypatch):
    monkeypatch.setattr(devices, "memory_info", lambda d: (1 << 30, 1 << 30))
    net, calls = torch.nn.Linear(3, 4), []

    def fwd(v):
        calls.append(len(v))
        return net(v)

    for n in (5, 9, 1):
        assert devices.forward_rows("cuda", torch.ones(n, 3), 100, fwd, net) == 100
    devices.forward_rows("cuda", torch.ones(5, 3, dtype=torch.float64), 100,
                         lambda v: fwd(v.float()), net)
    assert calls == [2, 2]  # once for float32 rows, once for float64 rows


def test_a_16_gb_gpu_at_224_px_takes_fewer_rows_than_an_h200(monkeypatch):
    model = build_model("resnet18", (3, 224, 224), 10).eval()
    params, buffers = base.split_state(model)
    x = torch.zeros(4, 3, 224, 224)
    rows = {}
    for gib in (16, 139):
        monkeypatch.setattr(devices, "memory_info", lambda d, g=gib: (g << 30, g << 30))
        rows[gib] = devices.forward_rows("cuda", x, base.FEATURE_BATCH,
                                         lambda v: base.forward(model, params, buffers, v))
    assert 1 <= rows[16] < rows[139] <= base.FEATURE_BATCH
    assert rows[16] < base.FEATURE_BATCH // 8  # 4096 rows at 224 px would not fit 16 GB
    monkeypatch.undo()
    assert devices.forward_rows("cpu", x, 7, lambda v: 1 / 0) == 7  # no probe on the CPU


def test_feature_and_evaluation_passes_stay_within_a_capped_device(monkeypatch):
    """On a simulated device of 24 MB, features and class scores of 600 rows (whose one pass
    would take more than the cap: the default batches are 4096 and 256 rows) are computed in
    smaller passes, never past the cap, with the CPU's values."""
    from fakedevice import current_memory

    from protofl.algorithms.registry import make_algorithm
    from protofl.metrics.federated import scores
    from protofl.models.nets import leaf_cnn

    torch.manual_seed(0)
    model = leaf_cnn((1, 28, 28), 10).eval()
    alg = make_algorithm("fedavg", {}, model, 10)
    params, buffers = base.split_state(model)
    x = torch.rand(600, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    want_z = base.features(model, params, buffers, x)
    want_s = scores(alg, model, params, buffers, {}, x, 600)
    with simulated(memory=24 << 20) as dev:
        model.to(dev)
        p, b = devices.to_device(params, dev), devices.to_device(buffers, dev)
        z = base.features(model, p, b, x.to(dev)).inner
        s = scores(alg, model, p, b, {}, x, 600).inner
        mem = current_memory()
    model.to("cpu")
    assert 0 < mem.peak <= mem.cap
    assert torch.allclose(z, want_z, atol=1e-5) and torch.allclose(s, want_s, atol=1e-5)


# ---- deterministic: true ----

def test_deterministic_switches_torch_while_a_run_runs_and_restores_what_it_found(
        monkeypatch):
    monkeypatch.delenv(devices.CUBLAS_ENV, raising=False)
    found = devices._settings()
    seen = []
    exp = Experiment(config_from_dict({**tiny("fedavg", "sequential"), "deterministic": True,
                                       "rounds": 1}))
    step = exp.step
    exp.step = lambda: (seen.append(devices._settings()), step())[1]
    exp.run()
    assert devices._settings() == found  # the caller's settings back after the run
    try:
        devices.set_deterministic(True)
        assert seen == [devices._settings()]  # what held during the run
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ[devices.CUBLAS_ENV] == ":4096:8"
    finally:
        devices.set_deterministic(False)
    assert devices._settings() == found
    assert config_from_dict({}).deterministic is False
    with pytest.raises(ProtoflError, match="deterministic"):
        config_from_dict({"deterministic": "yes please"})


def test_deterministic_changes_nothing_on_the_cpu():
    raw = tiny("fedproto", "vectorized")
    want = Experiment(config_from_dict(raw)).run()
    try:
        got = Experiment(config_from_dict({**raw, "deterministic": True})).run()
    finally:
        devices.set_deterministic(False)
    assert figures(got) == figures(want)


def test_onehot_prototype_sums_are_the_class_sums():
    z = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    y = torch.tensor([2, 0, 2])
    want = torch.tensor([[3.0, 4.0], [0.0, 0.0], [6.0, 8.0]])  # by hand
    assert torch.equal(prototype_math.onehot_sums(z, y, 3), want)
    assert torch.equal(prototype_math.class_sums(z, y, 3)[0], want)  # the CPU's index_add_
