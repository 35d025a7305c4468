"""One resolver, one builder, aggregation layers and a Python API without side effects."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import protofl
from protofl.config import config_from_dict
from protofl.data.registry import load_dataset
from protofl.engine import private
from protofl.engine.aggregation import Aggregation
from protofl.engine.federation import build
from protofl.engine.private import stack
from protofl.engine.spec import RunSpec, resolve, resolve_data
from protofl.errors import ProtoflError

SRC = Path(__file__).resolve().parents[1] / "src" / "protofl"
TINY = {"rounds": 2, "data": {"name": "digits", "num_clients": 4}, "clients": {"per_round": 2}}


def spec_of(raw: dict) -> RunSpec:
    cfg = config_from_dict(raw)
    return resolve(cfg, load_dataset(resolve_data(cfg.data), lean=True))


@pytest.mark.parametrize("raw", [
    {**TINY, "algorithm": "fedproin"},
    {**TINY, "algorithm": "central"},
    {"algorithm": "pgfl", "privacy": {"noise_multiplier": 1.0}},
    {"algorithm": "fedavg", "data": {"name": "shapes", "num_clients": 3, "image_size": 16,
                                     "max_samples": 30}, "clients": {"per_round": 2}},
], ids=["fedproin", "central", "dp", "segmentation"])
def test_resolving_a_spec_again_changes_nothing(raw):
    spec = spec_of(raw)
    assert isinstance(spec, RunSpec)
    again = spec_of(json.loads(json.dumps(spec.to_dict())))  # as config.json holds it
    assert again.to_dict() == spec.to_dict()


def test_resolve_fills_every_default_in_one_pass():
    spec = spec_of({**TINY, "algorithm": "fedproin"})
    c = spec.clients
    assert (c.optimizer, c.lr, c.batch_size, c.local_epochs) == ("adam", 1e-4, 128, 5)  # paper
    assert spec.data.partition == "dirichlet" and spec.data.augment == "none"  # the dataset's
    assert spec.model.name == "digits_cnn" and spec.threads == 1 and spec.workers >= 1
    assert spec.algo == spec_of({**TINY, "algorithm": "fedproin", "algo": spec.algo}).algo
    assert spec_of({"algorithm": "pgfl"}).algorithm == "fedmargin"
    assert spec_of({"algorithm": "fedmargin"}).clients.sampling == "weighted"  # its paper's
    dp = spec_of({"algorithm": "fedmargin", "privacy": {"noise_multiplier": 1.0}})
    assert dp.clients.sampling == "uniform"  # DP cannot account for size-weighted sampling
    seg = spec_of({"algorithm": "fedavg", "data": {"name": "shapes", "num_clients": 3,
                                                   "max_samples": 30, "image_size": 16},
                    "clients": {"per_round": 2}})
    assert (seg.model.width, seg.model.seg_channels, seg.model.output_stride) == (0.5, 64, 16)
    central = spec_of({**TINY, "algorithm": "central"})
    assert (central.clients.per_round, central.clients.stragglers) == (1, 0.0)
    assert central.clients.local_steps >= 1 and central.metrics.save_weights


def test_only_the_resolver_fills_defaults():
    """No module but engine/spec.py both reads a declared default (an option's fallback, an
    algorithm's paper settings, a dataset's partition or model) and replaces a section."""
    declared = ("fallback", "client_defaults", "model_options", "DEEPLAB_KEYS")
    fillers = []
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        if "dataclasses.replace(" in text and any(d in text for d in declared):
            fillers.append(path.relative_to(SRC).as_posix())
    assert fillers == ["engine/spec.py"]


def test_build_leaves_the_callers_generator_alone_and_repeats():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b = build(config_from_dict(TINY)), build(config_from_dict(TINY))
    assert torch.equal(torch.get_rng_state(), before)
    for k, v in a.state["params"].items():
        assert torch.equal(v, b.state["params"][k])
    assert a.alg.federation.num_clients == 4 and len(a.alg.federation.train_sizes) == 4
    assert a.train_data is a.data
    central = build(config_from_dict({**TINY, "algorithm": "central"}))
    assert central.train_data.num_clients == 1 and central.data.num_clients == 4


def layers_of(agg: Aggregation) -> list[str]:
    return [type(layer).__name__ for layer in getattr(agg, "layers", ())] or [
        type(agg).__name__]


@pytest.mark.parametrize("privacy, want", [
    ({}, ["Aggregation"]),
    ({"noise_multiplier": 1.0},
     ["ServerClip", "Sum", "GaussianNoise", "Estimate", "Accounting"]),
    ({"noise_multiplier": 1.0, "noise": "client"},
     ["ClientClip", "Sum", "GaussianNoise", "Estimate", "Accounting"]),
    ({"secagg": True}, ["ClientClip", "Sum", "Estimate"]),
    ({"noise_multiplier": 1.0, "adaptive_clip": True, "clip_count_std": 1.0},
     ["AdaptiveClip", "ServerClip", "Sum", "GaussianNoise", "Estimate", "Accounting"]),
])
def test_the_aggregation_stack_is_chosen_once_from_the_spec(privacy, want):
    fed = build(config_from_dict({"algorithm": "fedavg", "clients": {"per_round": 3},
                                  "privacy": privacy}))
    agg = stack(fed.spec, fed.alg, fed.data.num_clients, fed.state)
    assert layers_of(agg) == want
    client = privacy.get("noise") == "client" or "secagg" in privacy
    assert (agg.client_hook() is None) == (not client)
    noise = [layer for layer in getattr(agg, "layers", ()) if isinstance(
        layer, private.GaussianNoise)]
    if noise:
        assert noise[0].by == ("client" if privacy.get("noise") == "client" else "server")
    assert agg.noised == (privacy.get("noise_multiplier", 0) > 0)
    assert agg.private == bool(privacy)


def test_the_round_loop_has_no_privacy_branch():
    tree = ast.parse((SRC / "engine" / "experiment.py").read_text())
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert not {n for n in names if "priva" in n or n in ("secagg", "noise_multiplier")}


def test_run_changes_no_global_state_and_returns_a_run(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(2 if threads != 2 else 1)
    want_threads = torch.get_num_threads()
    torch.manual_seed(7)
    before = torch.get_rng_state()
    try:
        run = protofl.run({**TINY, "algorithm": "fedprox"}, out=tmp_path / "r")
        assert torch.get_num_threads() == want_threads
        assert torch.equal(torch.get_rng_state(), before)
    finally:
        torch.set_num_threads(threads)
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["accuracy"] for r in run.records] == [r["accuracy"] for r in lines]
    assert run.spec.algorithm == "fedprox" and run.folder == tmp_path / "r"
    model = run.model()
    x, _ = run.experiment.data.client_test(0)
    with torch.no_grad():
        logits = model(run.experiment.data.inputs(x))[1]
    assert logits.shape == (len(x), 10)
    assert set(run.state_dict()) == set(model.state_dict())
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["provenance"]["protofl"] == protofl_version()
    assert summary["provenance"]["torch"].split("+")[0] == torch.__version__.split("+")[0]


def test_running_with_a_run_folder_never_loads_pyplot(tmp_path):
    """Plots are drawn on matplotlib Figures: a fresh interpreter that runs protofl with a
    run folder (curves, confusion matrix, partition figure) never imports pyplot, so it
    never picks or forces a backend."""
    code = ("import sys, protofl; protofl.run({'rounds': 1, 'data': {'name': 'digits', "
            f"'num_clients': 4}}, 'clients': {{'per_round': 2}}}}, out={str(tmp_path / 'r')!r})"
            "; print('matplotlib.pyplot' in sys.modules, 'matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "True"]  # matplotlib drew the figures, pyplot was never loaded
    assert (tmp_path / "r" / "curves.png").exists()


def protofl_version() -> str:
    from importlib.metadata import version

    return version("protofl")


def test_run_takes_a_yaml_path_and_repeats(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm: fedavg\nrounds: 2\ndata: {name: digits, num_clients: 4}\n"
                    "clients: {per_round: 2}\n")
    a, b = protofl.run(path), protofl.run(str(path))
    drop = [{k: v for k, v in r.items() if k != "seconds"} for r in a.records]
    assert drop == [{k: v for k, v in r.items() if k != "seconds"} for r in b.records]
    with pytest.raises(ProtoflError, match="no aggregate model"):
        protofl.run({**TINY, "algorithm": "fedproto", "rounds": 1}).state_dict()


def test_protofl_build_takes_what_protofl_run_takes(tmp_path):
    """``protofl.build`` takes a dict with the YAML's keys or a config file, as ``run`` does."""
    import json

    import protofl

    raw = {"algorithm": "fedavg", "rounds": 1, "data": {"name": "digits", "num_clients": 4},
           "clients": {"per_round": 2}}
    fed = protofl.build(raw)
    assert fed.spec.algorithm == "fedavg" and fed.data.num_clients == 4
    (tmp_path / "c.json").write_text(json.dumps(raw))
    assert protofl.build(str(tmp_path / "c.json")).spec == fed.spec
    assert protofl.build({"task": "segmentation"}).spec.data.name == "shapes"


def test_evaluation_takes_every_core_the_run_may_use():
    """Training at ``threads``, evaluating between rounds at ``max(threads, workers)`` (the
    workers' cores are idle then), and the run's count back for the next round."""
    from protofl.engine.callbacks import Callback
    from protofl.engine.trainers import usable_cores

    seen: list[tuple[str, int]] = []

    class Threads(Callback):
        def after_aggregate(self, view, record, results):
            seen.append(("train", torch.get_num_threads()))

        def on_evaluate(self, view, record):
            seen.append(("eval", torch.get_num_threads()))

    protofl.run({**TINY, "threads": 1, "workers": 2}, callbacks=[Threads()])
    wide = min(2, usable_cores())
    assert seen == [("train", 1), ("eval", wide)] * 2
