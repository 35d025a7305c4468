"""protofl's own algorithms, models, datasets and partitions pass the public conformance kit
(``protofl.testing``) that plugins are checked with, and the kit catches each way a plugin
can break the contract. Flower's round trip of every algorithm is ``tests/test_flower.py``'s
one simulation (one Ray start for all)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from protofl import option
from protofl.algorithms.fedavg import FedAvg
from protofl.algorithms.registry import algorithm_names
from protofl.data.partition import SCHEMES
from protofl.testing import (
    ConformanceError,
    check_algorithm,
    check_dataset,
    check_model,
    check_partition,
)

# fedplvm's default loss multiplies rounding differences by ~1e5 per step (|cos|^0.25 near
# its 1e-4 floor, / tau = 0.07, x lambda = 100): vmap's batched matmuls round differently
# from mm at 1e-17, which its default lambda turns into 1e-8 by round 2; a smaller lambda
# keeps every term of the loss and the comparison at 1e-9
OPTIONS = {"fedplvm": {"lam": 1.0}}
# options that change what a client computes, checked besides the defaults
VARIANTS = {"fedproin-influence-final": ("fedproin", {"influence": "final"}),
            "moon-head-side": ("moon", {"head": "side"})}
CASES = {**{n: (n, OPTIONS.get(n, {})) for n in algorithm_names()}, **VARIANTS}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_algorithm_keeps_the_contract(case):
    name, options = CASES[case]
    report = check_algorithm(name, options, flower=False)
    assert {"contract", "options", "uploads", "trainers", "resume", "privacy",
            "memory"} <= set(report.passed)


@pytest.mark.parametrize("model,shape", [("mlp", (60,)), ("digits_cnn", (1, 8, 8)),
                                         ("leaf_cnn", (1, 28, 28)),
                                         ("fedavg_cnn", (3, 32, 32)), ("lenet5", (1, 28, 28))])
def test_small_models_keep_the_contract(model, shape):
    assert "vectorized" in check_model(model, shape).passed


def test_a_batchnorm_model_is_trained_sequentially_and_says_why():
    report = check_model("resnet10", (3, 16, 16))  # model.norm group: vmappable
    assert "vectorized" in report.passed
    from protofl.models.nets import ProtoNet

    class Normed(ProtoNet):
        def __init__(self, in_shape, num_classes):
            super().__init__()
            self.norm = torch.nn.BatchNorm1d(in_shape[0])
            self.feature_dim = in_shape[0]
            self.classifier = torch.nn.Linear(in_shape[0], num_classes)

        def encode(self, x):
            return self.norm(x)

    report = check_model(Normed, (4,), 3)
    assert report.skipped and "BatchNorm1d" in report.skipped[0][1]


@pytest.mark.parametrize("dataset,config", [("synthetic", {"num_clients": 5}),
                                            ("digits", {}), ("cifar_tiny", {})])
def test_datasets_that_need_no_download_keep_the_contract(dataset, config):
    check_dataset(dataset, config)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_partition_schemes_keep_the_contract(scheme):
    check_partition(scheme)


# ---- the kit catches each broken property in one line ----

def broken(prop: str, algorithm) -> str:
    with pytest.raises(ConformanceError) as e:
        check_algorithm(algorithm, flower=False, only=(prop,))
    lines = str(e.value).splitlines()
    assert any(f": {prop}: " in line for line in lines), lines
    return next(line for line in lines if f": {prop}: " in line)


class OldContract(FedAvg):
    contract = 1


class Unregistered(torch.nn.Module):
    pass


@dataclass
class LenientOptions:
    mu: float = option(0.1, "a weight", ge=0)


class Lenient(FedAvg):
    name, description = "lenient", "drops its options instead of validating them"
    Options = LenientOptions

    def __init__(self, options, model, num_classes, federation=None):
        super().__init__({}, model, num_classes, federation)


class Undeclared(FedAvg):
    name, description = "undeclared", "uploads an entry its upload_spec does not list"

    def client_end(self, t):
        up, state = super().client_end(t)
        return {**up, "extra": torch.zeros(2)}, state


class Sized(FedAvg):
    name, description = "sized", "a loss context whose shape differs between clients"

    def client_begin(self, c):
        return {"ones": torch.ones(len(c.y))}


class Forgetful(FedAvg):
    """Keeps a count outside its state: a resumed run does not see it."""

    name, description = "forgetful", "a server counter kept on the object, not in its state"
    calls = 0

    def aggregate(self, state, uploads, round):
        new, diag = super().aggregate(state, uploads, round)
        type(self).calls += 1
        new["params"] = {k: v * (1 + 1e-3 * type(self).calls) for k, v in new["params"].items()}
        return new, diag


def test_the_kit_names_the_property_that_broke():
    assert "hook contract 1" in broken("contract", OldContract)
    assert "not a subclass" in broken("contract", Unregistered)
    assert "algo.not_an_option = 1 is accepted" in broken("options", Lenient)
    assert "extra" in broken("uploads", Undeclared)
    assert "fell back to the sequential loop" in broken("trainers", Sized)
    assert "resumed run" in broken("resume", Forgetful)


def test_a_report_lists_each_property_it_checked():
    report = check_algorithm("fedavg", flower=False, only=("uploads", "flower"))
    text = str(report)
    assert "algorithm 'fedavg': uploads: ok" in text and "trainers" not in text
    assert "algorithm 'fedavg': flower: skipped (flower=False)" in text
