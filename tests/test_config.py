import pytest

from protofl.config import apply_set, config_from_dict, load_raw
from protofl.errors import ProtoflError


def test_defaults_and_nested_values():
    cfg = config_from_dict({"rounds": 3, "clients": {"lr": 1}, "algo": {"mu": 0.1}})
    assert cfg.rounds == 3 and cfg.clients.lr == 1.0 and cfg.algo == {"mu": 0.1}
    assert cfg.algorithm == "fedmargin" and cfg.data.name == "synthetic"


@pytest.mark.parametrize("raw, needle", [
    ({"roundz": 3}, "unknown key 'roundz'"),
    ({"clients": {"lrr": 1}}, "unknown key 'clients.lrr'"),
    ({"rounds": -1}, "rounds"),
    ({"clients": {"stragglers": 1.0}}, "clients.stragglers"),
    ({"clients": {"per_round": 0}}, "clients.per_round"),
    ({"clients": {"lr": "fast"}}, "clients.lr"),
    ({"rounds": 2.5}, "rounds"),
    ({"data": 3}, "data must be a mapping"),
])
def test_bad_values_name_the_key(raw, needle):
    with pytest.raises(ProtoflError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        config_from_dict(raw)


def test_apply_set_parses_yaml_values():
    raw = {}
    apply_set(raw, "clients.lr=0.05")
    apply_set(raw, "clients.tolerate_partial=false")
    apply_set(raw, "algo.weights=fair")
    cfg = config_from_dict(raw)
    assert cfg.clients.lr == 0.05 and cfg.clients.tolerate_partial is False
    assert cfg.algo["weights"] == "fair"
    with pytest.raises(ProtoflError, match="KEY=VALUE"):
        apply_set(raw, "novalue")


def test_load_raw_errors(tmp_path):
    with pytest.raises(ProtoflError, match="config file"):
        load_raw(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1, 2\n")
    with pytest.raises(ProtoflError, match="not valid YAML"):
        load_raw(bad)
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n")
    with pytest.raises(ProtoflError, match="mapping"):
        load_raw(top)


def test_numeric_strings_are_numbers():
    """YAML 1.1 reads 1e-3 as a string; a number key takes it as the number it spells."""
    raw = {}
    apply_set(raw, "clients.lr=1e-3")
    apply_set(raw, "rounds=1e1")
    cfg = config_from_dict(raw)
    assert cfg.clients.lr == 1e-3 and cfg.rounds == 10
    with pytest.raises(ProtoflError, match="clients.lr"):
        config_from_dict({"clients": {"lr": "nan"}})
    with pytest.raises(ProtoflError, match="finite"):
        config_from_dict({"data": {"alpha": float("inf")}})


def test_paths_expand_the_home_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = config_from_dict({"data": {"root": "~/data/mnist"}})
    assert cfg.data.root == str(tmp_path / "data" / "mnist")


@pytest.mark.parametrize("seed", [-1, 2**32, 10**30])
def test_seeds_outside_numpy_and_torch_range_are_refused(seed):
    with pytest.raises(ProtoflError, match="seed"):
        config_from_dict({"seed": seed})


def test_empty_config_file_is_refused(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    with pytest.raises(ProtoflError, match="empty"):
        load_raw(empty)


def test_a_declared_range_binds_every_model():
    """model.norm is checked up front, whatever the model (it passed silently with an MLP)."""
    with pytest.raises(ProtoflError, match="model.norm"):
        config_from_dict({"model": {"name": "mlp", "norm": "layer"}})


@pytest.mark.parametrize("model", [{"norm": "batch"}, {"pretrained": "weights.pt"}])
def test_norm_and_pretrained_are_refused_for_models_without_them(model):
    """A valid value that the model would ignore (an MLP has no normalisation) is refused."""
    from protofl.engine.experiment import Experiment

    cfg = config_from_dict({"data": {"name": "synthetic", "num_clients": 4},
                            "clients": {"per_round": 2}, "model": {"name": "mlp", **model}})
    with pytest.raises(ProtoflError, match=f"model.{next(iter(model))} applies to resnet18"):
        Experiment(cfg)


@pytest.mark.parametrize("algorithm,expected", [
    ("fedproin", {"optimizer": "adam", "lr": 1e-4, "batch_size": 128, "local_epochs": 5}),
    ("moon", {"optimizer": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-5,
              "batch_size": 64, "local_epochs": 10}),
    ("fedavg", {"optimizer": "sgd", "lr": 0.01, "momentum": 0.0, "weight_decay": 0.0,
                "batch_size": 10, "local_epochs": 1})])
def test_local_training_takes_the_papers_settings_unless_set(algorithm, expected):
    from protofl.engine.experiment import Experiment

    raw = {"algorithm": algorithm, "data": {"name": "digits", "num_clients": 4},
           "clients": {"per_round": 2}}
    got = Experiment(config_from_dict(raw)).cfg.clients
    assert {k: getattr(got, k) for k in expected} == expected
    raw["clients"].update({"optimizer": "sgd", "lr": 0.5, "batch_size": 7})  # the config wins
    exp = Experiment(config_from_dict(raw))
    assert (exp.cfg.clients.optimizer, exp.cfg.clients.lr, exp.cfg.clients.batch_size) == (
        "sgd", 0.5, 7)
    assert (exp.setup.optimizer, exp.setup.lr, exp.setup.batch_size) == ("sgd", 0.5, 7)
