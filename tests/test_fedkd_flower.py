"""FedKD on Flower's simulation with heterogeneous models (as tests/test_hetero_flower.py runs
HtFLlib's other methods): two nodes, each its group's mentor with the shared mentee; the run
ends in the engine's state and figures."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'protofl[flower]')")

from flwr.app import Context  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from simulation import client_app, simulate  # noqa: E402

from protofl.config import config_from_dict  # noqa: E402
from protofl.engine.experiment import Experiment  # noqa: E402
from protofl.flower.server_app import run_on_grid  # noqa: E402
from protofl.nested import flatten  # noqa: E402


def cfg():
    return config_from_dict({
        "algorithm": "fedkd", "seed": 0, "rounds": 2, "trainer": "sequential",
        "checkpoint_every": 2, "data": {"name": "digits", "num_clients": 2},
        "model": {"per_client": ["cnn1", "mlp"]},
        "clients": {"per_round": 2, "local_steps": 3, "batch_size": 16},
        "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 0}})


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("fedkd_flower")
    done: dict = {}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        done["fedkd"] = run_on_grid(cfg(), grid, root / "fedkd", node_wait=300)

    simulate(server, client_app(), 2, {})
    return done["fedkd"]


def test_flower_runs_fedkd_on_heterogeneous_models_as_the_engine_does(simulated):
    ref = Experiment(cfg())
    ref_summary = ref.run()
    a, b = flatten(simulated.state), flatten(ref.state)
    assert a.keys() == b.keys() and any(k.startswith("mentee.") for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5)
    assert simulated.last["local_accuracy"] == pytest.approx(ref_summary["local_accuracy"],
                                                             abs=1e-6)
