"""Property-based tests at the command line: random ``--set`` strings, random config files and
damaged data files thrown at ``protofl run`` (each example a one-round run of a few tiny
clients). Every answer is exit 0, or exit 2 (bad input) / 3 (divergence) with one error line;
never a traceback; and no file outside the run folder changes."""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from test_loaders_fuzz import MNIST, damage, damages, leaf_doc, write_leaf_split, write_mnist

from protofl.algorithms.registry import ALGORITHMS
from protofl.cli import main
from protofl.config import Config, declared, option_rows

# PROTOFL_FUZZ_EXAMPLES=N: N random (not derandomized) examples per test, for a longer hunt
HUNT = int(os.environ.get("PROTOFL_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=HUNT or 20, deadline=None, derandomize=not HUNT,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# what keeps an example a one-round run of a few tiny clients: given first, so a fuzzed key
# may still change any of them to another small or invalid value
TINY = {"rounds": "1", "data.num_clients": "3", "clients.per_round": "2",
        "clients.local_steps": "1", "clients.batch_size": "8", "metrics.dissimilarity_clients": "0",
        "metrics.train_loss_samples": "20", "data.max_samples": "200", "threads": "1"}
COST = {*TINY, "clients.local_epochs", "metrics.eval_batch", "data.image_size", "eval_every",
        "checkpoint_every", "algo.server_epochs", "algo.prototypes_per_class",
        "algo.proj_dim", "algo.hidden", "algo.max_local", "algo.max_global"}
KEYS = sorted({k for k, *_ in option_rows()} | COST - {"callbacks", "data.root",
                                                         "model.pretrained"})



def valid_values() -> dict[str, list[str]]:
    """A few allowed values of every declared option (choices, booleans, the default, twice
    the default), as ``--set`` text."""
    out: dict[str, list[str]] = {}

    def walk(cls: type, prefix: str) -> None:
        for name, hint, default, rule in declared(cls):
            if hasattr(hint, "__dataclass_fields__"):
                walk(hint, f"{prefix}{name}.")
            elif rule is not None:
                vals = [json.dumps(default)]
                if rule.choices:
                    vals += [str(c) for c in rule.choices]
                elif isinstance(default, bool):
                    vals += ["true", "false"]
                elif isinstance(default, (int, float)) and not isinstance(default, bool):
                    vals.append(json.dumps(default * 2 if default else 1))
                out[f"{prefix}{name}"] = vals

    walk(Config, "")
    return out


VALID = valid_values()
small = st.one_of(st.integers(1, 3), st.integers(-3, 4),
                  st.sampled_from(["0", "1e0", "2.0", "-1", "x", "", "null", "[1]", "{a: 1}",
                                   "true", "1.5"]))
scalar = st.one_of(
    st.integers(-10, 10), st.integers(-2**70, 2**70),
    st.floats(allow_nan=True, allow_infinity=True, width=32).map(repr),
    st.sampled_from(["1e-3", "-1e-3", "1e5", "1e308", "-1e308", "1e-300", "3.5e38", "-0.0",
                     "nan", "inf", ".inf", "null", "~", "true", "no",
                     "[]", "[1, 2]", "{}", "{x: 1}", "'quoted'", "\"", ":", "- a", "&a *a",
                     "fedavg", "digits", "synthetic", "uniform", "weighted", "client",
                     "server", "iid", "dirichlet", "classes", "adam", "batch", "rdp", "pld",
                     "poisson", "cnn", "resnet18", "mlp", "auto", "vectorized"]),
    st.text(max_size=6))
paths = st.sampled_from(["nowhere", "cfg.yaml", "data", "data/train", "other/keep.txt",
                         "~", "/nonexistent/x", ""])
callbacks = st.sampled_from(["[]", "[nope:X]", "['json:dumps']", "['protofl:nothing']",
                             "['protofl.engine.callbacks:Callback']", "x", "[1]"])


@st.composite
def assignment(draw) -> str:
    """One ``--set`` string: mostly a real key with a fitting value, sometimes malformed."""
    kind = draw(st.sampled_from(["key"] * 8 + ["path", "callbacks", "bogus", "malformed"]))
    if kind == "malformed":
        return draw(st.sampled_from(["noequals", "=5", ".=1", "a..b=1", "rounds", "data.=x",
                                     "data.name.x=1", "clients=3", "algo=fedavg",
                                     "algo.x.y=1"]))
    if kind == "path":
        return f"{draw(st.sampled_from(['data.root', 'model.pretrained']))}={draw(paths)}"
    if kind == "callbacks":
        return f"callbacks={draw(callbacks)}"
    key = draw(st.sampled_from(KEYS)) if kind == "key" else draw(st.sampled_from(
        ["bogus", "data.bogus", "algo.bogus", "privacy.bogus", "Rounds", "clients.lr.x"]))
    if key in COST:
        value = draw(small)
    elif key in VALID and draw(st.booleans()):
        value = draw(st.sampled_from(VALID[key]))
    else:
        value = draw(scalar)
    return f"{key}={value}"


def snapshot(root: Path, skip: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` but inside ``skip``: (size, mtime in ns)."""
    out = {}
    for p in root.rglob("*"):
        if p.is_file() and skip not in p.parents:
            st_ = p.stat()
            out[str(p.relative_to(root))] = (st_.st_size, st_.st_mtime_ns)
    return out


@contextlib.contextmanager
def workspace():
    """A scratch folder as the working directory, holding files a run must not touch: a
    config file, a data folder and an unrelated file."""
    old = os.getcwd()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "other").mkdir()
        (root / "other" / "keep.txt").write_text("keep")
        (root / "cfg.yaml").write_text("rounds: 1\n")
        write_leaf_split(root / "data", leaf_doc(), leaf_doc(seed=1))
        os.chdir(root)
        try:
            yield root
        finally:
            os.chdir(old)


def run_cli(root: Path, args: list[str]) -> int:
    """``protofl run ARGS --out run -q``: the exit code; a refusal is one error line, and
    nothing outside the run folder changed."""
    out = root / "run"
    before = snapshot(root, out)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["run", "-q", "--out", str(out), *args])
    text = err.getvalue()
    assert "Traceback" not in text, text
    assert code in (0, 2, 3), (code, text)
    if code:
        errors = [line for line in text.splitlines() if line.startswith("protofl: error:")]
        assert len(errors) == 1, text
    else:
        assert (out / "summary.json").is_file()
    assert snapshot(root, out) == before, "a file outside the run folder changed"
    event(f"exit {code}")
    return code


def tiny_sets() -> list[str]:
    return [a for k, v in TINY.items() for a in ("--set", f"{k}={v}")]


@FUZZ
@given(st.sampled_from(["synthetic", "digits"]), st.sampled_from(sorted(ALGORITHMS)),
       st.lists(assignment(), min_size=1, max_size=4))
# what the fuzzing found (tracebacks before they were fixed)
@example("synthetic", "fedavg", ["callbacks=['json:dumps']"])
@example("synthetic", "fedavg", ["clients.lr=1e308", "trainer=sequential"])
@example("digits", "fedprox", ["clients.weight_decay=1e308"])
@example("synthetic", "fedmargin", ["privacy.noise_multiplier=1e308"])
@example("synthetic", "fedavg", ["privacy.noise_multiplier=1e-300"])
def test_random_set_strings(dataset, algorithm, sets):
    with workspace() as root:
        run_cli(root, ["--dataset", dataset, "--algorithm", algorithm, *tiny_sets(),
                       *[a for s in sets for a in ("--set", s)]])


# random config files: mostly mappings of real keys with allowed or random values (nested by
# section), sometimes a list, a scalar or no YAML at all
leaf_value = st.one_of(st.integers(-5, 5), st.floats(allow_nan=False, width=32),
                       st.booleans(), st.none(), st.text(max_size=5),
                       st.lists(st.integers(0, 3), max_size=2))


@st.composite
def config_doc(draw):
    shape = draw(st.sampled_from(["mapping"] * 5 + ["list", "scalar"]))
    if shape != "mapping":
        return draw(st.lists(leaf_value, max_size=3) if shape == "list" else leaf_value)
    doc: dict = {}
    for key in draw(st.lists(st.sampled_from([*KEYS, "bogus", "data.bogus", "algo.bogus"]),
                             max_size=4, unique=True)):
        if key in COST:
            value = draw(st.one_of(st.integers(-2, 3), leaf_value))
        elif key in VALID and draw(st.booleans()):
            value = yaml.safe_load(draw(st.sampled_from(VALID[key])))
        else:
            value = draw(leaf_value)
        top, _, rest = key.partition(".")
        if rest and isinstance(doc.get(top, {}), dict):
            doc.setdefault(top, {})[rest] = value
        else:
            doc[key] = value
    return doc


@FUZZ
@given(config_doc(), st.sampled_from(["yaml", "json", "text"]), st.text(max_size=30))
def test_random_config_files(doc, form, text):
    with workspace() as root:
        path = root / ("fuzz.json" if form == "json" else "fuzz.yaml")
        path.write_text(json.dumps(doc) if form == "json" else
                        yaml.safe_dump(doc) if form == "yaml" else text)
        # the fuzzed file may not make runs tiny, so the tiny settings follow it (--set wins)
        run_cli(root, [str(path), *tiny_sets()])


@settings(FUZZ, max_examples=HUNT or 12)
@given(st.sampled_from(["mnist", "leaf"]), st.integers(0, 3), damages)
def test_damaged_data_files_at_the_cli(source, which, how):
    with workspace() as root:
        data = root / "fuzzdata"
        data.mkdir()
        if source == "mnist":
            write_mnist(data, gz=False)
            target = data / MNIST[which]
        else:
            write_leaf_split(data, leaf_doc(n_users=4), leaf_doc(n_users=4, seed=1))
            target = data / ("train" if which % 2 else "test") / "d.json"
        damage(target, how)
        sets = tiny_sets() + ["--set", f"data.name={source}", "--set", f"data.root={data}",
                              "--set", "data.max_samples=null"]
        if source == "leaf":
            sets += ["--set", "data.num_clients=null"]
        run_cli(root, sets)
