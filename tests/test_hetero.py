"""Model-heterogeneous federations (models/families.py, engine/hetero.py)."""

from __future__ import annotations

import pytest
import torch

from protofl.algorithms.capabilities import personalized
from protofl.config import ModelConfig, config_from_dict
from protofl.errors import ProtoflError
from protofl.models import families


def hetero_cfg(algorithm="fedproto", models=("cnn1", "mlp", "cnn2"), **over):
    raw = {"algorithm": algorithm, "rounds": 2, "checkpoint_every": 0, "seed": 3,
           "threads": 1, "trainer": "sequential",
           "data": {"name": "digits", "num_clients": 6, "partition": "dirichlet",
                    "alpha": 0.1},
           "model": {"per_client": list(models)},
           "clients": {"per_round": 6, "local_steps": 2, "batch_size": 8},
           "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 0}}
    for k, v in over.items():
        raw[k] = {**raw.get(k, {}), **v} if isinstance(v, dict) else v
    return config_from_dict(raw)


def test_client_k_gets_position_k_mod_n():
    g = families.ModelGroups(["a", "b", "a"], ["a", "b"])
    assert [g.of(k) for k in range(7)] == [0, 1, 0, 0, 1, 0, 0]
    assert g.clients(1, 7) == [1, 4]


def test_projection_pools_to_the_common_size_as_adaptive_average_pooling():
    """HtFLlib's AdaptiveAvgPool1d: 4 features pooled to 2 are the means of pairs."""
    class Four(families.ProtoNet):
        feature_dim = 4

        def __init__(self):
            super().__init__()
            self.classifier = torch.nn.Linear(4, 3)

        def encode(self, x):
            return x

    m = families.Projected(Four(), 2, 3)
    z = m.encode(torch.tensor([[1.0, 3.0, 5.0, 9.0]]))
    assert torch.equal(z, torch.tensor([[2.0, 7.0]]))
    assert m(torch.zeros(1, 4))[1].shape == (1, 3)
    lin = families.Projected(Four(), 2, 3, "linear")
    assert lin.encode(torch.zeros(5, 4)).shape == (5, 2)


def test_families_share_the_feature_size():
    cfg = ModelConfig(family="htfe-img")
    groups, dim = families.build_groups(cfg, (1, 8, 8), 10)
    assert dim == 512 and len(groups.models) == 4
    x = torch.zeros(2, 1, 8, 8)
    for m in groups.models:
        z, logits = m(x)
        assert z.shape == (2, 512) and logits.shape == (2, 10)
    names = [type(m).__name__ for m in groups.models]
    assert names == ["ConvNet", "Projected", "ResNet18", "ConvNet"]  # MobileNetV2 320 -> 512


def test_a_per_client_list_takes_the_first_models_feature_size():
    groups, dim = families.build_groups(ModelConfig(per_client=["mlp", "cnn1"]), (1, 8, 8), 10)
    assert dim == 256 and groups.models[1].feature_dim == 256


@pytest.mark.parametrize("model, needle", [
    ({"per_client": ["nope"]}, "unknown model 'nope'"),
    ({"family": "nope"}, "model.family = 'nope'"),
    ({"family": "htfe-cnn", "per_client": ["mlp"]}, "not both"),
    ({"per_client": ["mlp"], "name": "mlp"}, "model.name = 'mlp'"),
])
def test_bad_model_lists_are_one_line_errors(model, needle):
    with pytest.raises(ProtoflError, match=needle):
        families.resolve(ModelConfig(**model))


@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", "fedmargin", "moon"])
def test_weight_averaging_methods_are_refused(algorithm, tmp_path):
    from protofl.engine.experiment import Experiment

    with pytest.raises(ProtoflError, match="cannot train heterogeneous models") as e:
        Experiment(hetero_cfg(algorithm))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("algorithm", ["fedproto", "fedtgp", "fedproin"])
def test_every_client_trains_and_is_scored_with_its_own_model(algorithm):
    from protofl.engine.experiment import Experiment

    algo = {"server_epochs": 2} if algorithm == "fedtgp" else {}
    exp = Experiment(hetero_cfg(algorithm, algo=algo))
    summary = exp.run()
    groups = exp.alg.groups
    assert exp.cfg.model.name == "heterogeneous" and personalized(exp.alg)
    assert sorted(exp.client_states) == list(range(6))
    for k, st in exp.client_states.items():  # each keeps the weights of its own model
        model = groups.models[groups.of(k)]
        assert {n: tuple(v.shape) for n, v in st["params"].items()} == {
            n: tuple(p.shape) for n, p in model.named_parameters()}
    assert len(summary["client_accuracy"]) == 6  # every client scored
    assert 0 <= summary["accuracy"] <= 1


def test_vectorized_and_parallel_give_the_sequential_numbers():
    from protofl.engine.experiment import Experiment

    def run(trainer, **kw):
        exp = Experiment(hetero_cfg("fedproto", trainer=trainer, **kw))
        exp.run()
        return exp

    seq, vec = run("sequential"), run("vectorized")
    par = run("parallel", workers=2)
    for k in seq.client_states:
        for other in (vec, par):
            for n, v in seq.client_states[k]["params"].items():
                torch.testing.assert_close(other.client_states[k]["params"][n], v)
    torch.testing.assert_close(vec.state["protos"], seq.state["protos"])


def test_a_killed_heterogeneous_run_resumes_bit_identically(tmp_path, kill_after):
    from protofl import api
    from protofl.engine import runfolder as rf

    cfg = hetero_cfg("fedtgp", rounds=3, checkpoint_every=1, algo={"server_epochs": 2})
    api.run_experiment(cfg, tmp_path / "full")
    with kill_after(1), pytest.raises(KeyboardInterrupt):
        api.run_experiment(cfg, tmp_path / "killed")
    api.resume_experiment(tmp_path / "killed")

    def strip(rows):
        return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]

    assert strip(rf.read_metrics(tmp_path / "killed")) == strip(
        rf.read_metrics(tmp_path / "full"))
    a, b = rf.load_checkpoint(tmp_path / "full"), rf.load_checkpoint(tmp_path / "killed")
    for k in a["client_states"]:
        for n, v in a["client_states"][k]["params"].items():
            assert torch.equal(b["client_states"][k]["params"][n], v)


def test_the_heterogeneous_suite_pairs_each_method_with_one_shared_model(tmp_path):
    from protofl.suites import plan
    from protofl.suites_hetero import budget_name

    jobs = plan("heterogeneous", tmp_path)
    assert len(jobs) == 3 * 2 * 3  # methods x (family, shared) x seeds
    for raw, _ in jobs:
        assert raw["data"]["partition"] == "dirichlet" and raw["data"]["alpha"] == 0.1
        model = raw["model"]
        assert model.get("family") == "htfe-cnn" or model.get("per_client") == ["cnn2"]
        config_from_dict(raw)  # every config valid
    # --budget paper: HtFLlib's protocol (tests/test_suites.py checks it in full)
    assert budget_name("heterogeneous", "paper") == "heterogeneous-paper"
    raw = plan("heterogeneous-paper", tmp_path)[0][0]
    assert (raw["clients"]["batch_size"], raw["clients"]["lr"]) == (10, 0.01)
    with pytest.raises(ProtoflError, match="no --budget"):
        budget_name("main", "paper")
