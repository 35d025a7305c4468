"""The seams of docs/architecture.md hold: layers import only layers below them, the engine
and the metrics name no algorithm's upload key, and every option is declared once (the docs
table is generated from the declarations)."""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
from pathlib import Path

import pytest

from protofl.algorithms.registry import ALGORITHMS, algorithm_class, make_algorithm
from protofl.config import Config, declared, markdown_table
from protofl.engine.spec import fill
from protofl.models.nets import Mlp

SRC = Path(__file__).resolve().parents[1] / "src" / "protofl"
DOCS = Path(__file__).resolve().parents[1] / "docs"

# bottom to top: a module may import its own layer's modules and those of lower layers
LAYERS = [
    {"errors", "config", "seeding", "nested", "tasks", "device", "provenance", "sizes",
     "plugins"},
    {"data"},
    {"models"},
    {"algorithms", "privacy"},
    {"metrics"},
    {"engine"},
    {"report"},
    {"api", "cli", "suite", "suites", "suites_hetero", "reproduce", "flower", "doctables",
     "executor", "__init__", "__main__", "testing"},
]


def layer_of(module: str) -> int:
    """``protofl.engine.train`` -> the index of the layer holding ``engine``."""
    part = module.split(".")[1] if "." in module else "__init__"
    for i, names in enumerate(LAYERS):
        if part in names:
            return i
    raise AssertionError(f"{module} is in no layer of docs/architecture.md")


MODULE_PATH = re.compile(r"protofl(\.\w+)+(:\w+)?")  # "protofl.data.digits:digits_federation"
TOP = {p.stem for p in SRC.iterdir()}  # protofl's packages and top-level modules


def protofl_imports(path: Path) -> set[str]:
    """Every ``protofl.*`` module a source file imports: at the top or inside functions,
    relative imports resolved, and modules named by a string (``importlib.import_module``,
    registries of ``"module:attribute"`` paths)."""
    package = ["protofl", *path.relative_to(SRC).parent.parts]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("protofl")}
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = ".".join(package[:len(package) - node.level + 1])
            mods = [f"{base}.{node.module}"] if node.module else [
                f"{base}.{a.name}" for a in node.names]
            out |= set(mods)
        elif isinstance(node, ast.ImportFrom) and node.module == "protofl":
            out |= {f"protofl.{a.name}" for a in node.names}  # from protofl import tasks
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
                "protofl"):
            out.add(node.module)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and MODULE_PATH.fullmatch(node.value) and node.value.split(".")[1] in TOP):
            out.add(node.value.split(":")[0])
    return out


def test_relative_and_string_imports_count(tmp_path, monkeypatch):
    """The layer check sees imports that climb by a relative path or by a module's name."""
    pkg = tmp_path / "data"
    pkg.mkdir()
    (pkg / "x.py").write_text("from ..engine import experiment\nfrom . import store\n"
                              "import importlib\nimportlib.import_module('protofl.report.html')\n"
                              "TABLE = {'a': 'protofl.flower.setup:build'}\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    found = protofl_imports(pkg / "x.py")
    assert found == {"protofl.engine", "protofl.data.store", "protofl.report.html",
                     "protofl.flower.setup"}
    assert max(layer_of(m) for m in found) > layer_of("protofl.data.x")  # a violation


def modules() -> dict[str, Path]:
    return {"protofl." + ".".join(p.relative_to(SRC).with_suffix("").parts): p
            for p in SRC.rglob("*.py")}


def test_every_module_has_a_layer():
    for name in modules():
        layer_of(name.removesuffix(".__init__"))


@pytest.mark.parametrize("name", sorted(modules()))
def test_layers_import_only_downwards(name):
    own = layer_of(name.removesuffix(".__init__"))
    for target in protofl_imports(modules()[name]):
        assert layer_of(target) <= own, f"{name} (layer {own}) imports {target}"


def test_algorithms_never_import_the_engine():
    for name, path in modules().items():
        if name.startswith("protofl.algorithms"):
            assert not any(t.startswith(("protofl.engine", "protofl.flower"))
                           for t in protofl_imports(path)), name


def algorithm_upload_keys() -> set[str]:
    """The upload keys that belong to particular algorithms (not FedAvg's own)."""
    keys = set()
    for name in ALGORITHMS:
        alg = make_algorithm(name, {}, Mlp(4, 3, hidden=(5,)), 3)
        keys |= {k for k in alg.upload_spec() if not k.startswith(("params.", "buffers."))}
    keys -= {"num_samples"}
    assert {"protos", "counts", "influence", "local_protos"} <= keys  # the check has teeth
    return keys


def test_engine_metrics_and_flower_name_no_algorithm_upload_key():
    keys = algorithm_upload_keys()
    for name, path in modules().items():
        if name.startswith(("protofl.engine", "protofl.metrics", "protofl.flower")):
            strings = {n.value for n in ast.walk(ast.parse(path.read_text()))
                       if isinstance(n, ast.Constant) and isinstance(n.value, str)}
            assert not strings & keys, f"{name} names {strings & keys}"


def option_classes() -> list[type]:
    """Config's sections and every algorithm's Options."""
    sections = [h for _, h, _, _ in declared(Config) if dataclasses.is_dataclass(h)]
    return [Config, *sections, *(algorithm_class(n).Options for n in ALGORITHMS)]


@pytest.mark.parametrize("cls", option_classes(), ids=lambda c: c.__name__)
def test_every_option_is_declared(cls):
    for name, hint, default, rule in declared(cls):
        if dataclasses.is_dataclass(hint) or (cls is Config and name == "algo"):
            continue  # sections, and algo (each algorithm declares its own)
        assert rule is not None, f"{cls.__name__}.{name} has no option() declaration"
        assert rule.help.strip(), f"{cls.__name__}.{name} has no help"
        assert rule.ok(default), f"{cls.__name__}.{name}: default {default!r} breaks its rule"


def test_algorithm_client_defaults_are_declared_values():
    sections = {n: h for n, h, _, _ in declared(Config)}
    clients = sections["clients"]()
    for name in ALGORITHMS:
        defaults = algorithm_class(name).client_defaults
        rules = {n: r for n, _, _, r in declared(type(clients))}
        for key, value in defaults.items():
            assert key in rules and rules[key].ok(value), (name, key, value)
        resolved = fill(clients, defaults)
        assert all(getattr(resolved, k) == v for k, v in defaults.items())


def test_docs_tables_are_generated_from_the_declarations(tmp_path):
    """docs/configuration.md's options and docs/algorithms.md's table are what `protofl docs`
    writes; a declaration changed without regenerating them fails here."""
    from protofl.doctables import SECTIONS, write_docs

    assert write_docs(DOCS, check=True) == [], "run `protofl docs`"
    text = (DOCS / "configuration.md").read_text()
    assert markdown_table() in text
    for name in ALGORITHMS:
        assert markdown_table(algorithm_class(name).Options, "algo.") in text, name
    files = [file for file, _ in SECTIONS.values()]
    for file in files:  # the check has teeth
        head, marker, tables = (DOCS / file).read_text().partition("-->\n")  # the marker's
        (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / file).write_text(head + marker + tables.replace("`", "`x", 1))
    assert sorted(write_docs(tmp_path, check=True)) == sorted(str(tmp_path / f) for f in files)


def test_run_help_lists_every_option(capsys):
    from protofl.cli import main

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    for key in ("rounds", "clients.lr", "metrics.amm", "data.partition", "callbacks"):
        assert f"  {key} = " in out, key


def test_a_new_metric_is_one_callback(tmp_path):
    """A user's per-round metric: one Callback subclass, given from the config by import path;
    its figure lands in metrics.jsonl."""
    import json

    from protofl.api import run_experiment
    from protofl.config import config_from_dict

    cfg = config_from_dict({"algorithm": "fedavg", "rounds": 2, "checkpoint_every": 0,
                            "data": {"name": "digits", "num_clients": 4},
                            "clients": {"per_round": 2, "local_steps": 1},
                            "metrics": {"dissimilarity_clients": 0},
                            "callbacks": ["callbacks_example:GlobalNorm"]})
    run_experiment(cfg, tmp_path / "run")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n")
            if x]
    assert [r["round"] for r in rows] == [1, 2]
    assert all(r["weight_norm"] > 0 for r in rows)
    resolved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert resolved["callbacks"] == ["callbacks_example:GlobalNorm"]


def test_config_json_is_the_resolved_config(tmp_path):
    """Every default filled in: the algorithm's options and client defaults, the model, the
    client count and the partition; an explicitly set default resolves to the same config."""
    import json

    from protofl.api import run_experiment
    from protofl.config import config_from_dict

    base = {"algorithm": "fedmargin", "rounds": 1, "checkpoint_every": 0,
            "data": {"name": "digits"}, "clients": {"per_round": 2, "local_steps": 1},
            "metrics": {"dissimilarity_clients": 0}}
    explicit = {**base, "algo": {"weights": "attention"},
                "data": {"name": "digits", "num_clients": 10, "partition": "dirichlet"}}
    run_experiment(config_from_dict(base), tmp_path / "a")
    run_experiment(config_from_dict(explicit), tmp_path / "b")
    a, b = (json.loads((tmp_path / n / "config.json").read_text()) for n in "ab")
    assert a == b
    assert a["model"]["name"] == "digits_cnn" and a["data"]["num_clients"] == 10
    assert a["data"]["partition"] == "dirichlet"
    assert a["clients"]["sampling"] == "weighted" and a["clients"]["tolerate_partial"] is True
    assert a["algo"]["reduce"] == "sum" and len(a["algo"]) == 9
    assert (a["clients"]["optimizer"], a["clients"]["lr"], a["clients"]["batch_size"],
            a["clients"]["local_epochs"]) == ("sgd", 0.01, 10, 1)  # the fallbacks
    again = config_from_dict(a)  # a resolved config is a valid config that resolves to itself
    assert dataclasses.asdict(again) == a


def test_no_function_is_over_60_lines():
    long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno - node.lineno + 1 > 60:
                    long.append(f"{name}.{node.name}")
    assert long == []


def test_the_configs_walk_climbs_back_at_most_six_times():
    """scripts/config_walk.py: the resolver is visited once per descent (issue 30's target)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        import config_walk
    finally:
        sys.path.pop(0)
    walked = config_walk.stops(config_walk.walk())
    climbs = [(a, b) for (a, _), (b, _) in zip(walked, walked[1:]) if layer_of(b) > layer_of(a)]
    assert len(climbs) <= 6, climbs
