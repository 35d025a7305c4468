"""Heterogeneous models on Flower: nodes train their group's model (results equal the
engine's), or the model their node config names (``model``). One simulation, two nodes."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'protofl[flower]')")

from flwr.app import Context, Message  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from simulation import client_app, simulate  # noqa: E402

from protofl.config import config_from_dict  # noqa: E402
from protofl.engine import hetero  # noqa: E402
from protofl.engine.experiment import Experiment  # noqa: E402
from protofl.errors import ProtoflError  # noqa: E402
from protofl.flower.server_app import run_on_grid  # noqa: E402

OWN = {0: "cnn2", 1: "mlp_small"}  # the "own" case's node configs


# HtFLlib's methods and FPL, at their defaults but for shorter server training
METHODS = ("fd", "lgfedavg", "fedgh", "fedgen", "fpl", "fml", "fedkd", "fedmrl")
FAST = {"fedgh": {"server_epochs": 3},
        "fedgen": {"server_steps": 5, "server_batch": 8, "samples_per_class": 3}}


def cfg(own: bool = False, algorithm: str = "fedproto"):
    """The run; ``own``: the same but for its checkpoints, and each node names its model."""
    return config_from_dict({
        "algorithm": algorithm, "seed": 0, "algo": FAST.get(algorithm, {}), "rounds": 2,
        "trainer": "sequential",
        "checkpoint_every": 1 if own else 2, "data": {"name": "digits", "num_clients": 2},
        "model": {"per_client": ["cnn1", "mlp"]},
        "clients": {"per_round": 2, "local_steps": 3, "batch_size": 16},
        "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 0}})


def _with_node_model(handler):
    """In the ``own`` run each node names its own model, as --node-config 'model=...' does."""
    def run(msg: Message, context: Context) -> Message:
        records = msg.content.config_records
        rec = records["job"] if "job" in records else records["query"]
        own = "config" in rec and json.loads(str(rec["config"]))["checkpoint_every"] == 1
        pid = int(context.node_config["partition-id"])
        context.node_config.pop(hetero.NODE_MODEL, None)
        if own:
            context.node_config[hetero.NODE_MODEL] = OWN[pid]
        return handler(msg, context)

    return run


@pytest.fixture(scope="module")
def simulated(tmp_path_factory) -> dict:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("hetero_flower")
    done: dict = {}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        for own in (False, True):
            done[own] = run_on_grid(cfg(own), grid, root / f"own{own}", node_wait=300)
        for name in METHODS:
            done[name] = run_on_grid(cfg(algorithm=name), grid, root / name, node_wait=300)

    simulate(server, client_app(wrap=_with_node_model), 2, {})
    return done


def test_flower_nodes_train_their_groups_model_as_the_engine_does(simulated):
    exp = simulated[False]
    ref = Experiment(cfg())
    ref_summary = ref.run()
    torch.testing.assert_close(exp.state["protos"], ref.state["protos"], rtol=1e-5, atol=1e-5)
    assert exp.last["local_accuracy"] == pytest.approx(ref_summary["local_accuracy"], abs=1e-6)


@pytest.mark.parametrize("name", METHODS)
def test_flower_runs_each_heterogeneous_method_as_the_engine_does(simulated, name):
    from protofl.nested import flatten

    exp = simulated[name]
    ref = Experiment(cfg(algorithm=name))
    ref_summary = ref.run()
    a, b = flatten(exp.state), flatten(ref.state)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5)
    assert exp.last["local_accuracy"] == pytest.approx(ref_summary["local_accuracy"], abs=1e-6)


def test_flower_nodes_train_the_model_their_node_config_names(simulated):
    """The same run but for the nodes' models: other prototypes."""
    exp = simulated[True]
    assert exp.round == 2 and exp.last["clients_evaluated"] == 2
    assert not torch.allclose(exp.state["protos"], simulated[False].state["protos"])


def test_node_view_gives_a_named_model_and_its_own_initial_weights():
    text = json.dumps(Experiment(cfg()).cfg.to_dict())
    node = Experiment(config_from_dict(json.loads(hetero.node_config(text, "mlp_small"))))
    assert node.alg.groups.distinct == ["mlp_small"] and node.alg.model.feature_dim == 128
    broadcast = {"init": {"params": {}, "buffers": {}}, "protos": torch.zeros(10, 128),
                 "present": torch.zeros(10)}
    alg, tree = hetero.node_view(node.alg, node.state, broadcast, 1, own_model=True)
    assert tree["init"] is node.state["init"]["m0"] and alg.model is node.alg.groups.models[0]
    plain = json.dumps(config_from_dict({}).to_dict())
    with pytest.raises(ProtoflError, match="needs a heterogeneous run"):
        hetero.node_config(plain, "mlp")
