"""Secure aggregation on Flower's simulation engine: SecAgg+ runs end with the global state of
the plain in-process run, to SecAgg+'s quantisation tolerance; the server never holds an
upload; client-side DP noise travels inside the masked sum. One Ray start runs every case."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'protofl[flower]')")

from flwr.app import Context  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from simulation import client_app, simulate  # noqa: E402

from protofl.config import Config, config_from_dict  # noqa: E402
from protofl.engine.experiment import Experiment  # noqa: E402
from protofl.errors import ProtoflError  # noqa: E402
from protofl.flower.node import AUDIT_ENV  # noqa: E402
from protofl.flower.server_app import run_on_grid  # noqa: E402
from protofl.nested import flatten  # noqa: E402

CLIENTS = 3
# SecAgg+ quantises each entry of a contribution to 2^22 levels over [-8, 8] (stochastic
# rounding, unseeded): about 4e-6 per entry and client after round 1; round 2's local
# training from those weights amplifies it (measured: up to about 2e-4). A wrong rule (a
# client missing, uniform instead of n_k weights) moves weights by 1e-2 and more.
TOL = 1e-3


def tiny(algorithm: str, privacy: dict, algo: dict | None = None, rounds: int = 2) -> Config:
    return config_from_dict({
        "algorithm": algorithm, "seed": 0, "rounds": rounds, "trainer": "sequential",
        "checkpoint_every": rounds, "data": {"name": "synthetic", "num_clients": CLIENTS},
        "clients": {"per_round": CLIENTS, "batch_size": 50},
        "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 50},
        "privacy": privacy, "algo": algo or {}})


SECAGG = {"secagg": True, "secagg_max_weight": 200.0}
REPRO = {"reproducible_noise": True}  # seeded noise (not private): runs to compare
CASES = {
    "fedavg": tiny("fedavg", SECAGG),
    "fedprox": tiny("fedprox", SECAGG),
    "fedmargin": tiny("fedmargin", SECAGG, {"scores": "client"}),
    "fedproin": tiny("fedproin", SECAGG, rounds=1),
    "dp": tiny("fedavg", {**SECAGG, **REPRO, "noise_multiplier": 0.5, "noise": "client"}),
    # DP without SecAgg: the server noises raw uploads, or the ClientApps send noised shares
    "dp_server": tiny("fedmargin", {**REPRO, "noise_multiplier": 0.5}, {"weights": "fair"}),
    "dp_client": tiny("fedmargin", {**REPRO, "noise_multiplier": 0.5, "noise": "client"},
                      {"scores": "client"}),
}


@pytest.fixture(scope="module")
def simulated(tmp_path_factory) -> dict:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("flower_secagg")
    done: dict = {}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        for name, cfg in CASES.items():
            done[name] = run_on_grid(cfg, grid, root / name, round_timeout=600, node_wait=300)

    done["seconds"] = simulate(server, client_app(), CLIENTS,
                               {AUDIT_ENV: str(root / "audit")})  # the nodes' audit logs
    done["root"] = root
    return done


def plain(cfg: Config) -> Experiment:
    """The same run in process, without secure aggregation."""
    raw = cfg.to_dict()
    raw["privacy"] = {}
    exp = Experiment(config_from_dict(raw))
    exp.run()
    return exp


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "fedmargin", "fedproin"])
def test_secagg_run_ends_with_the_plain_state(simulated, name):
    assert name in simulated, "the simulation did not run this case"
    exp = simulated[name]
    assert exp.trainer.name == "flower-secagg" and exp.round == CASES[name].rounds
    ref = plain(CASES[name])
    a, b = flatten(exp.state), flatten(ref.state)
    assert a.keys() == b.keys()
    gap = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    print(f"{name}: largest difference to the plain run {gap:.2e}")
    assert gap < TOL
    rows = [json.loads(x) for x in (simulated["root"] / name / "metrics.jsonl").read_text()
            .splitlines()]
    assert all(r["clients"] == [0, 1, 2] and r["rejected"] == [] for r in rows)
    assert all("weights" not in r and "amm" not in r for r in rows)  # no one upload is seen
    assert rows[-1]["client_loss"] == pytest.approx(
        json.loads((simulated["root"] / name / "summary.json").read_text())["client_loss"])


def test_secagg_with_client_noise_logs_epsilon(simulated):
    exp = simulated["dp"]
    rows = [json.loads(x) for x in (simulated["root"] / "dp" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    assert 0 < rows[0]["epsilon"] < rows[1]["epsilon"]
    # the same run in process: same clients, same noise shares (seeded), same epsilon
    ref = Experiment(CASES["dp"])
    ref.run()
    assert rows[-1]["epsilon"] == pytest.approx(ref.aggregation.epsilon())
    for k, v in flatten(exp.state).items():
        torch.testing.assert_close(v.double(), flatten(ref.state)[k].double(), rtol=0,
                                   atol=TOL)


@pytest.mark.parametrize("name", ["dp_server", "dp_client"])
def test_dp_on_flower_equals_the_dp_run_in_process(simulated, name):
    """Seeded noise, the same clients: a DP run on Flower (no SecAgg) ends in the state of
    the same DP run in process, and logs the same epsilon."""
    exp = simulated[name]
    assert exp.trainer.name == "flower"
    ref = Experiment(CASES[name])
    ref.run()
    for k, v in flatten(exp.state).items():
        torch.testing.assert_close(v, flatten(ref.state)[k], rtol=1e-5, atol=1e-5)
    assert ref.last["epsilon"] > 0
    assert exp.last["epsilon"] == pytest.approx(ref.last["epsilon"])


def test_secagg_refuses_algorithms_that_need_each_upload():
    with pytest.raises(ProtoflError, match="algo.scores: client"):
        Experiment(tiny("fedmargin", SECAGG))
    with pytest.raises(ProtoflError, match="fedatt cannot run under secure aggregation"):
        Experiment(tiny("fedatt", SECAGG))
