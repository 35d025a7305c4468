"""protofl's contract made executable, for your own pytest (as scikit-learn's ``check_estimator``).

Hand-worked tests of an algorithm's hooks build their contexts with :func:`client_round` and
:func:`trained`; the ``check_*`` functions run the shared checks every built-in algorithm,
model, dataset and partition passes.
"""

from __future__ import annotations

import dataclasses
import tempfile
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from protofl import plugins
from protofl.algorithms.base import Algorithm, Tensors
from protofl.algorithms.contract import ClientRound, TrainedClient
from protofl.config import TASKS, Rule, config_from_dict, declared, merge
from protofl.data.federated import FederatedData, from_client_lists
from protofl.engine.schedule import Job
from protofl.engine.train import ClientResult, LocalSetup, RoundContext, SequentialTrainer
from protofl.errors import ProtoflError
from protofl.models.nets import Mlp
from protofl.nested import flatten


def client_round(alg: Algorithm, broadcast: Tensors, x: torch.Tensor | None = None,
                 y: torch.Tensor | None = None, state: Tensors | None = None,
                 **settings: Any) -> ClientRound:
    """A :class:`ClientRound` for calling ``alg.client_begin`` by hand: round 1, client 0,
    ``alg.model``, SGD at lr 0.01, one step, unless ``settings`` say otherwise."""
    x = torch.zeros(0) if x is None else x
    y = torch.zeros(0, dtype=torch.long) if y is None else y
    fields = {"round": 1, "client": 0, "model": alg.model, "lr": 0.01, "steps": 1,
              "batch_size": max(len(y), 1), "optimizer": "sgd", "momentum": 0.0,
              "weight_decay": 0.0, "generator": torch.Generator().manual_seed(0), **settings}
    return ClientRound(broadcast=broadcast, state=state or {}, x=x, y=y, **fields)


def trained(c: ClientRound, params: Tensors, buffers: Tensors | None = None,
            ctx: Tensors | None = None, stats: Tensors | None = None) -> TrainedClient:
    """The :class:`TrainedClient` for ``alg.client_end`` after ``c``'s local training made
    ``params``/``buffers`` (``ctx``: what ``client_begin`` returned)."""
    base = {f.name: getattr(c, f.name) for f in dataclasses.fields(ClientRound)}
    return TrainedClient(**base, params=params, buffers=buffers or {}, ctx=ctx or {},
                         stats=stats or {})


# ---- the conformance kit ----

class ConformanceError(AssertionError):
    """A plugin breaks the contract: one line per property that broke."""


@dataclass
class Report:
    """What a ``check_*`` found: the properties that held, those skipped (and why), those
    that broke (and how). ``str(report)`` is one line per property."""

    subject: str
    passed: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join([*(f"{self.subject}: {p}: ok" for p in self.passed),
                          *(f"{self.subject}: {p}: skipped ({why})" for p, why in self.skipped),
                          *(f"{self.subject}: {p}: FAILED {why}" for p, why in self.failed)])

    def run(self, prop: str, check: Callable[[], str | None]) -> None:
        """Record property ``prop``: ``check()`` returns None (it holds) or why it was skipped;
        an exception is the one line saying how it broke."""
        try:
            skipped = check()
        except Exception as e:  # noqa: BLE001 - every failure becomes one line of the report
            self.failed.append((prop, one_line(e)))
        else:
            if skipped:
                self.skipped.append((prop, skipped))
            else:
                self.passed.append(prop)

    def raise_failures(self) -> Report:
        if self.failed:
            raise ConformanceError("\n".join(f"{self.subject}: {p}: {why}"
                                             for p, why in self.failed))
        return self


def depth(tree: Any) -> int:
    """How many levels of dicts ``tree`` nests (a tensor: 0)."""
    return 1 + max(map(depth, tree.values()), default=0) if isinstance(tree, dict) else 0


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    head = text[0] if text else ""
    return head if isinstance(e, (ProtoflError, ConformanceError)) else (
        f"{type(e).__name__}: {head}")


def _need(ok: bool, why: str) -> None:
    if not ok:
        raise ConformanceError(why)


C = 3  # classes of the toy federation
TOY_SIZES = (13, 3, 9, 22)  # its clients: one smaller than a batch, unequal sizes
# two rounds of jobs: a straggler doing one unit of work among full ones
TOY_JOBS = [Job(0, 3), Job(1, 3), Job(2, 1, straggler=True), Job(3, 3)]
TOY_SETUPS = {"sgd+momentum, local steps": LocalSetup(4, True, "sgd", 0.1, 0.9, 1e-3, seed=1),
              "adam, local epochs": LocalSetup(5, False, "adam", 0.01, 0.0, 1e-2, seed=2)}
# a run of a few seconds on scikit-learn's digits (no download) for the run-level checks
TINY_RUN = {"rounds": 3, "seed": 1, "trainer": "sequential", "threads": 1,
            "checkpoint_every": 1, "data": {"name": "digits", "num_clients": 4},
            "clients": {"per_round": 2, "local_steps": 2, "batch_size": 16},
            "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 40, "every": 0}}


def toy_federation() -> FederatedData:
    """Four clients of 5-feature rows and 3 classes (the default dtype's floats)."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, 5, generator=g) for n in TOY_SIZES]
    ys = [torch.arange(n) % C for n in TOY_SIZES]
    return from_client_lists("conformance", C, xs, ys, local_test_fraction=0.0)


def _name(obj: Any) -> str:
    """A plugin's name for a config: the string given, else the object's import path."""
    return obj if isinstance(obj, str) else plugins.register(obj)


def _toy_algorithm(name: str, options: dict, data: FederatedData) -> Algorithm:
    from protofl.algorithms.registry import make_algorithm
    from protofl.engine.federation import info

    torch.manual_seed(0)
    return make_algorithm(name, options, Mlp(5, C, hidden=(8, 6)), C, info(data))


def _rounds(trainer: Any, name: str, options: dict, data: FederatedData, setup: LocalSetup,
            rounds: int = 2) -> list[list[ClientResult]]:
    """The results of ``rounds`` consecutive rounds of a newly built algorithm (its own run),
    client states carried between them."""
    alg = _toy_algorithm(name, options, data)
    state, client_states, out = alg.init_state(alg.model), {}, []
    for rnd in range(1, rounds + 1):
        res = trainer.train(RoundContext(alg, alg.broadcast(state), TOY_JOBS, data,
                                         client_states, setup, rnd))
        out.append(res)
        client_states.update({r.client: r.state for r in res if r.state})
        state, _ = alg.aggregate(state, [r.upload for r in res], rnd)
    return out


def _same(want: Any, got: Any, tol: float, what: str) -> None:
    """One line naming the first entry where ``got`` differs from ``want`` by more than
    ``tol`` (0: bit for bit)."""
    fa, fb = flatten(want), flatten(got)
    _need(fa.keys() == fb.keys(), f"{what}: keys differ ({sorted(set(fa) ^ set(fb))[:3]})")
    for k, a in fa.items():
        b = fb[k]
        if not isinstance(a, torch.Tensor):
            _need(a == b, f"{what}: {k} is {b!r}, not {a!r}")
            continue
        _need(tuple(a.shape) == tuple(b.shape), f"{what}: {k} has shape {tuple(b.shape)}, not "
                                                f"{tuple(a.shape)}")
        a, b = a.detach().cpu(), b.detach().cpu()
        if a.is_floating_point():
            diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
            _need(diff <= tol, f"{what}: {k} differs by {diff:.3g} (tolerance {tol:g})")
        else:
            _need(torch.equal(a, b), f"{what}: {k} differs")


def _same_results(want: list[list[ClientResult]], got: list[list[ClientResult]], tol: float,
                  what: str) -> None:
    for rnd, (w, g) in enumerate(zip(want, got), 1):
        _need([r.client for r in w] == [r.client for r in g],
              f"{what}: round {rnd} returned clients {[r.client for r in g]}, not "
              f"{[r.client for r in w]}")
        for a, b in zip(w, g):
            _same(a.upload, b.upload, tol, f"{what}: round {rnd}, client {a.client}'s upload")
            _same(a.state, b.state, tol, f"{what}: round {rnd}, client {a.client}'s state")
            _need(abs(a.loss - b.loss) <= max(tol, 1e-12),
                  f"{what}: round {rnd}, client {a.client}'s loss {b.loss} is not {a.loss}")


class float64:
    """Within the block, torch's default dtype is float64 (the equivalence tolerance)."""

    def __enter__(self) -> None:
        self.old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)

    def __exit__(self, *exc: Any) -> None:
        torch.set_default_dtype(self.old)


def bad_value(hint: Any, rule: Rule) -> Any:
    """A value that option ``rule`` (of type ``hint``) must refuse."""
    base = typing.get_args(hint)[0] if typing.get_origin(hint) in (
        typing.Union, types.UnionType) else hint
    if rule.choices:
        return "not-one-of-the-choices"
    for bound, step in ((rule.ge, -1), (rule.gt, 0), (rule.le, 1), (rule.lt, 0)):
        if bound is not None:
            return bound + step * max(1, abs(bound))
    return {bool: "maybe", int: "many", float: "much", str: 12345}.get(base, object())


def check_algorithm(algorithm: str | type, options: dict[str, Any] | None = None, *,
                    config: dict[str, Any] | None = None, tolerance: float = 1e-9,
                    flower: bool = True, only: tuple[str, ...] | None = None) -> Report:
    """Check that an algorithm (a name, an import path or the class) keeps protofl's
    contract, as every built-in does; raises :class:`ConformanceError` naming each property
    that broke, else returns the :class:`Report`. The properties:

    - ``contract``: an ``Algorithm`` subclass of this hook contract, with a name, a
      description, its tasks and every option declared;
    - ``options``: an out-of-range value of each option, and an unknown one, refused in one line;
    - ``uploads``: each upload is what ``upload_spec`` says (at most two levels deep, every
      entry of a known kind);
    - ``trainers``: the vectorized and parallel trainers give the sequential trainer's
      uploads, client states and losses over two rounds, in float64 within ``tolerance``
      (parallel: bit for bit), with stragglers, momentum and Adam;
    - ``resume``: a run killed after round 2 and resumed ends exactly as an uninterrupted
      one (server state, client states, metrics), its state kept in safetensors and JSON;
    - ``privacy``: client-level DP and secure sums either run or are refused in one line;
    - ``memory``: the memory guard sizes it on the meta device;
    - ``cuda``: CPU and CUDA agree within 1e-4 (skipped without a GPU);
    - ``flower``: a Flower simulation of 2 rounds ends in the in-process engine's state
      (skipped without ``flwr``, or when ``flower`` is False).

    The run-level checks (resume, privacy, memory, flower) run a few rounds on digits with
    4 clients; ``config`` changes that run (e.g. ``{"data": {"name": "mydata"}}``).
    ``only`` runs the properties it names (the contract always).
    """
    name, options = _name(algorithm), dict(options or {})
    run = merge(TINY_RUN, config or {})
    checks: dict[str, Callable[[], str | None]] = {
        "options": lambda: _options(name, options),
        "uploads": lambda: _uploads(name, options),
        "trainers": lambda: _trainers(name, options, tolerance),
        "resume": lambda: _resume(name, options, run),
        "privacy": lambda: _privacy(name, options, run),
        "memory": lambda: _memory(name, options, run),
        "cuda": lambda: _cuda(name, options),
        "flower": lambda: _flower(name, options, run) if flower else "flower=False"}
    unknown = set(only or ()) - {"contract", *checks}
    if unknown:
        raise ValueError(f"only: no property {sorted(unknown)}; properties: contract, "
                         f"{', '.join(checks)}")
    report = Report(f"algorithm {name!r}")
    report.run("contract", lambda: _contract(name))
    if report.failed:  # nothing else can be built
        return report.raise_failures()
    for prop, check in checks.items():
        if only is None or prop in only:
            report.run(prop, check)
    return report.raise_failures()


def _contract(name: str) -> str | None:
    from protofl.algorithms.registry import algorithm_class

    cls = algorithm_class(name)  # the subclass and contract checks
    _need(isinstance(cls, type), "not a class")
    for attr in ("name", "description"):
        _need(isinstance(getattr(cls, attr), str) and getattr(cls, attr) != "base",
              f"class attribute {attr!r} is not set")
    _need(bool(cls.tasks) and set(cls.tasks) <= set(TASKS),
          f"tasks {cls.tasks!r} are not a subset of {TASKS}")
    _need(dataclasses.is_dataclass(cls.Options), "Options is not a dataclass")
    undeclared = [n for n, _, _, rule in declared(cls.Options) if rule is None]
    _need(not undeclared, f"option {undeclared[:1]} is not declared with config.option()")
    return None


def _options(name: str, options: dict) -> str | None:
    from protofl.algorithms.registry import algorithm_class

    cls = algorithm_class(name)
    data = toy_federation()
    for key, value in [("not_an_option", 1)] + [
            (n, bad_value(hint, rule)) for n, hint, _, rule in declared(cls.Options)]:
        try:
            _toy_algorithm(name, {**options, key: value}, data)
        except ProtoflError as e:
            _need("\n" not in str(e), f"algo.{key} = {value!r} is refused in several lines")
            continue
        raise ConformanceError(f"algo.{key} = {value!r} is accepted; an option declares "
                               "its range with config.option(..., ge=, choices=, ...)")
    return None


def _uploads(name: str, options: dict) -> str | None:
    from protofl.algorithms.base import KINDS, validate_upload

    data = toy_federation()
    alg = _toy_algorithm(name, options, data)
    if "classification" not in alg.tasks:
        return "written for segmentation only"
    for results in _rounds(SequentialTrainer(), name, options, data,
                           TOY_SETUPS["adam, local epochs"]):
        for r in results:
            validate_upload(r.upload, alg.upload_spec())
            flat, spec = flatten(r.upload), alg.upload_spec()
            _need(set(flat) == set(spec), f"upload keys {sorted(set(flat) ^ set(spec))[:3]} "
                                          "are missing from upload_spec() or from the upload")
            _need(depth(r.upload) <= 2, "an upload is more than two levels deep")
            for key, entry in spec.items():
                _need(entry.kind in KINDS, f"upload_spec()[{key!r}].kind {entry.kind!r} is "
                                           f"none of {sorted(KINDS)}")
                _need(not entry.weighed_by or spec.get(entry.weighed_by, entry).kind in (
                    "counts", "presence"), f"upload_spec()[{key!r}] is weighed by "
                                           f"{entry.weighed_by!r}, which is no counts entry")
    return None


def _trainers(name: str, options: dict, tolerance: float) -> str | None:
    from protofl.engine import vectorized
    from protofl.engine.parallel import ParallelTrainer
    from protofl.engine.vectorized import VectorizedTrainer

    with float64():
        data = toy_federation()
        alg = _toy_algorithm(name, options, data)
        if "classification" not in alg.tasks:
            return "written for segmentation only"
        reason = vectorized.vectorize_reason(alg.model)
        _need(reason is None, f"vectorized: {reason}")
        for label, setup in TOY_SETUPS.items():
            want = _rounds(SequentialTrainer(), name, options, data, setup)
            sequential = vectorized.SequentialTrainer
            vectorized.SequentialTrainer = None  # falling back to the sequential loop fails
            try:  # solo_max 2: the plain step for the last two clients of a step
                for solo in (0, 2):
                    got = _rounds(VectorizedTrainer(None, solo), name, options, data, setup)
                    _same_results(want, got, tolerance, f"vectorized ({label})")
            except TypeError as e:
                if "NoneType" not in str(e):
                    raise
                raise ConformanceError(f"vectorized ({label}): the round fell back to the "
                                       "sequential loop (its contexts or model cannot be "
                                       "stacked over clients)") from None
            finally:
                vectorized.SequentialTrainer = sequential
        setup = TOY_SETUPS["adam, local epochs"]
        want = _rounds(SequentialTrainer(), name, options, data, setup)
        trainer = ParallelTrainer(2, "sequential")
        try:
            got = _rounds(trainer, name, options, data, setup)
        finally:
            trainer.close()
        _same_results(want, got, 0.0, "parallel")
    return None


def _tiny_config(name: str, options: dict, run: dict, **over: Any) -> dict[str, Any]:
    return merge({**run, "algorithm": name, "algo": options}, over)


def _resume(name: str, options: dict, run: dict) -> str | None:
    from protofl.api import resume_experiment, run_experiment
    from protofl.engine import runfolder
    from protofl.engine.experiment import Experiment

    cfg = config_from_dict(_tiny_config(name, options, run))
    with tempfile.TemporaryDirectory(prefix="protofl-conformance-") as tmp:
        whole, killed = Path(tmp) / "whole", Path(tmp) / "killed"
        run_experiment(cfg, whole)
        step = Experiment.step

        def dying(self: Experiment) -> Any:
            if self.round == 2:
                raise KeyboardInterrupt
            return step(self)

        Experiment.step = dying  # type: ignore[method-assign]
        try:
            run_experiment(cfg, killed)
        except KeyboardInterrupt:
            pass
        finally:
            Experiment.step = step  # type: ignore[method-assign]
        _need(runfolder.load_checkpoint(killed)["round"] == 2,
              "the killed run's checkpoint is not round 2's")
        resume_experiment(killed)
        a, b = runfolder.load_checkpoint(whole), runfolder.load_checkpoint(killed)
        _same({k: a[k] for k in ("state", "client_states")},
              {k: b[k] for k in ("state", "client_states")}, 0.0, "resumed run")
        rows = [[{k: v for k, v in r.items() if k != "seconds"} for r in runfolder.read_metrics(f)]
                for f in (whole, killed)]
        _need(rows[0] == rows[1], "the resumed run's metrics.jsonl differs from an "
                                  "uninterrupted run's")
        pickled = [p.name for p in killed.rglob("*") if p.suffix in (".pt", ".pkl", ".pickle")]
        _need(not pickled, f"the run folder holds pickles: {pickled[:3]}")
    return None


def _privacy(name: str, options: dict, run: dict) -> str | None:
    from protofl.api import run_experiment

    for privacy in ({"noise_multiplier": 1.0, "reproducible_noise": True}, {"secagg": True}):
        cfg = config_from_dict(_tiny_config(name, options, run, rounds=1, privacy=privacy))
        try:
            run_experiment(cfg)
        except ProtoflError as e:
            _need("\n" not in str(e), f"privacy {privacy} is refused in several lines")
    return None


def _memory(name: str, options: dict, run: dict) -> str | None:
    from protofl import sizes
    from protofl.data.registry import load_dataset
    from protofl.engine.spec import meta_algorithm, resolve, resolve_data

    cfg = config_from_dict(_tiny_config(name, options, run))
    data = load_dataset(resolve_data(cfg.data), lean=True)
    spec = resolve(cfg, data)
    alg, _ = meta_algorithm(spec, data)
    _need(sizes.model_bytes(alg, spec) > 0, "the memory guard counts no bytes for its model")
    for entry in alg.server_bytes():
        _need(len(entry) == 4 and isinstance(entry[2], int) and entry[2] >= 0,
              f"server_bytes() entry {entry!r} is not (config key, value, bytes, what)")
    return None


def _cuda(name: str, options: dict) -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    data = toy_federation()
    setup = TOY_SETUPS["adam, local epochs"]
    want = _rounds(SequentialTrainer(), name, options, data, setup)
    got = _rounds(SequentialTrainer(), name, options, data,
                  dataclasses.replace(setup, device="cuda"))
    _same_results(want, got, 1e-4, "cuda")
    return None


def _flower(name: str, options: dict, run: dict) -> str | None:
    try:
        from flwr.simulation import run_simulation
    except ImportError:
        return "flwr is not installed (pip install 'protofl[flower]')"
    from protofl.engine.experiment import Experiment
    from protofl.flower.client_app import app as client
    from protofl.flower.server_app import make_server_app

    clients = config_from_dict(_tiny_config(name, options, run)).data.num_clients or 4
    cfg = config_from_dict(_tiny_config(name, options, run, rounds=2, clients={
        "per_round": clients}))
    done: list[Experiment] = []
    server = make_server_app(cfg, on_finish=done.append)
    run_simulation(server, client, num_supernodes=clients,
                   backend_config={"client_resources": {"num_cpus": 1},
                                   "init_args": {"num_cpus": 1, "include_dashboard": False}})
    _need(bool(done), "the Flower simulation did not finish (see Flower's log above)")
    ref = Experiment(cfg)
    ref.run()
    _same(ref.state, done[0].state, 1e-5, "flower")
    return None


def check_model(model: str | Callable[..., Any], in_shape: tuple[int, ...] = (1, 28, 28),
                num_classes: int = 10) -> Report:
    """Check that a model (a name, an import path or the factory ``(in_shape, num_classes) ->
    ProtoNet``) keeps protofl's contract for inputs of ``in_shape``; raises
    :class:`ConformanceError` naming each property that broke. The properties: ``builds`` (a
    ``ProtoNet`` with an integer ``feature_dim``), ``forward`` (``(z, logits)`` of shapes
    ``(B, d)`` and ``(B, C)``, finite, the same through ``torch.func.functional_call``),
    ``vectorized`` (vmap over two clients' weights gives each one's forward; skipped, with
    the reason, for a model the vectorized trainer cannot stack), ``meta`` (it builds on
    the meta device, where the memory guard sizes it), ``seeded`` (the same torch seed
    builds the same weights), ``weights`` (its state round-trips through safetensors) and
    ``trains`` (a FedAvg round of two clients lowers nothing to NaN and changes its weights)."""
    from protofl.models.registry import build_model

    name = _name(model)
    report = Report(f"model {name!r}")

    def build() -> Any:
        return build_model(name, tuple(in_shape), num_classes)

    report.run("builds", lambda: _need(isinstance(build().feature_dim, int), "no feature_dim"))
    if report.failed:
        return report.raise_failures()
    report.run("forward", lambda: _model_forward(build(), in_shape, num_classes))
    report.run("vectorized", lambda: _model_vmap(build(), in_shape))
    report.run("meta", lambda: _model_meta(build))
    report.run("seeded", lambda: _model_seeded(build))
    report.run("weights", lambda: _model_weights(build()))
    report.run("trains", lambda: _model_trains(build(), in_shape, num_classes))
    return report.raise_failures()


def _model_forward(net: Any, in_shape: tuple[int, ...], num_classes: int) -> None:
    from protofl.algorithms.base import forward, split_state

    net.eval()
    x = torch.randn(4, *in_shape, generator=torch.Generator().manual_seed(0))
    out = net(x)
    _need(isinstance(out, tuple) and len(out) == 2, "forward(x) does not return (z, logits)")
    z, logits = out
    _need(tuple(z.shape) == (4, net.feature_dim), f"z has shape {tuple(z.shape)}, not "
                                                  f"(4, feature_dim={net.feature_dim})")
    _need(tuple(logits.shape) == (4, num_classes), f"logits have shape {tuple(logits.shape)}, "
                                                   f"not (4, {num_classes})")
    _need(bool(torch.isfinite(z).all() and torch.isfinite(logits).all()), "z or logits hold "
                                                                          "NaN or Inf")
    params, buffers = split_state(net)
    fz, flogits = forward(net, params, buffers, x)
    _need(torch.equal(fz, z) and torch.equal(flogits, logits),
          "functional_call with its own weights differs from forward(x)")


def _model_vmap(net: Any, in_shape: tuple[int, ...]) -> str | None:
    from protofl.algorithms.base import forward, split_state
    from protofl.engine.vectorized import vectorize_reason

    reason = vectorize_reason(net)
    if reason is not None:
        return f"trained sequentially: {reason}"
    net.eval()
    params, buffers = split_state(net)
    other = {k: v + 0.01 for k, v in params.items()}
    stacked = {k: torch.stack([params[k], other[k]]) for k in params}
    x = torch.randn(3, *in_shape, generator=torch.Generator().manual_seed(1))
    z = torch.func.vmap(lambda p: forward(net, p, buffers, x)[1])(stacked)
    for i, p in enumerate((params, other)):
        want = forward(net, p, buffers, x)[1]
        _need(torch.allclose(z[i], want, atol=1e-5), "vmap over clients' weights differs from "
                                                     "each client's forward")
    return None


def _model_meta(build: Callable[[], Any]) -> None:
    with torch.device("meta"):
        net = build()
    _need(all(p.is_meta for p in net.parameters()), "building on the meta device allocates "
                                                    "weights (the memory guard builds it so)")


def _model_seeded(build: Callable[[], Any]) -> None:
    from protofl.algorithms.base import split_state

    torch.manual_seed(0)
    a = split_state(build())[0]
    torch.manual_seed(0)
    _same(a, split_state(build())[0], 0.0, "two builds under one seed")


def _model_weights(net: Any) -> None:
    from protofl.engine import tensorfile

    state = {k: v.detach() for k, v in net.state_dict().items()}
    _same(state, tensorfile.decode(tensorfile.encode(state)), 0.0, "safetensors round trip")


def _model_trains(net: Any, in_shape: tuple[int, ...], num_classes: int) -> None:
    from protofl.algorithms.registry import make_algorithm

    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, *in_shape, generator=g) for n in (6, 5)]
    ys = [torch.arange(n) % num_classes for n in (6, 5)]
    data = from_client_lists("conformance", num_classes, xs, ys, local_test_fraction=0.0)
    alg = make_algorithm("fedavg", {}, net, num_classes)
    before = alg.init_state(alg.model)
    rc = RoundContext(alg, alg.broadcast(before), [Job(0, 2), Job(1, 2)], data, {},
                      LocalSetup(4, True, "sgd", 0.05), 1)
    results = SequentialTrainer().train(rc)
    after, _ = alg.aggregate(before, [r.upload for r in results], 1)
    _need(all(torch.isfinite(torch.tensor(r.loss)) for r in results), "a training loss is NaN")
    _need(any(not torch.equal(before["params"][k], after["params"][k]) for k in after["params"]),
          "a round of SGD left every weight unchanged (no gradient reaches them)")


def check_dataset(dataset: str | Any, config: dict[str, Any] | None = None) -> Report:
    """Check that a dataset (a name, an import path, a ``DatasetSpec`` or a builder
    ``(DataConfig) -> FederatedData``) keeps protofl's contract; ``config``: the ``data.*``
    keys it needs (``root``, ...). Raises :class:`ConformanceError` naming each property that
    broke. The properties: ``spec`` (its entry: a task, a model or none), ``builds`` (a
    ``FederatedData`` whose every client holds training rows, labels in ``0..C-1`` and rows
    of one shape), ``deterministic`` (two builds give the same rows and clients), ``lean``
    (its rows kept in their source dtype become the same model inputs) and ``runs`` (a
    FedAvg round on it, with its model or ``model.name``)."""
    from protofl.config import DataConfig, build

    name = _name(dataset)
    report = Report(f"dataset {name!r}")
    raw = {**(config or {}), "name": name}
    cfg = build(DataConfig, {k: v for k, v in raw.items()}, "data")
    report.run("spec", lambda: _dataset_spec(name))
    report.run("builds", lambda: _dataset_builds(cfg))
    if report.failed:
        return report.raise_failures()
    report.run("deterministic", lambda: _dataset_deterministic(cfg))
    report.run("lean", lambda: _dataset_lean(cfg))
    report.run("runs", lambda: _dataset_runs(raw))
    return report.raise_failures()


def _load(cfg: Any, lean: bool = False) -> FederatedData:
    from protofl.data.registry import load_dataset
    from protofl.engine.spec import resolve_data

    return load_dataset(resolve_data(cfg), lean=lean)


def _dataset_spec(name: str) -> None:
    from protofl.data.registry import DatasetSpec, dataset_spec

    spec = dataset_spec(name)
    _need(isinstance(spec, DatasetSpec), "not a DatasetSpec")
    _need(spec.task in TASKS, f"task {spec.task!r} is none of {TASKS}")


def _dataset_builds(cfg: Any) -> None:
    data = _load(cfg)
    _need(data.num_clients >= 1, "no client")
    sizes = data.train_sizes
    _need(bool((sizes > 0).all()), f"client {int((sizes == 0).argmax())} holds no training row")
    for y in (data.y_train, data.y_test):
        if len(y):
            _need(int(y.min()) >= 0 and int(y[y != 255].max() if data.task == "segmentation"
                                                else y.max()) < data.num_classes,
                  f"a label lies outside 0..{data.num_classes - 1}")
    _need(tuple(data.x_train.shape[1:]) == tuple(data.x_test.shape[1:]) or not len(data.x_test),
          "training and test rows differ in shape")


def _dataset_deterministic(cfg: Any) -> None:
    a, b = _load(cfg), _load(cfg)
    _need(np.array_equal(a.train_offsets, b.train_offsets), "two builds split the clients "
                                                            "differently")
    _same({"x": a.x_train, "y": a.y_train, "xt": a.x_test, "yt": a.y_test},
          {"x": b.x_train, "y": b.y_train, "xt": b.x_test, "yt": b.y_test}, 0.0, "two builds")


def _dataset_lean(cfg: Any) -> None:
    full, lean = _load(cfg), _load(cfg, lean=True)
    n = min(len(full.x_train), 64)
    _same({"x": full.x_train[:n]}, {"x": lean.inputs(lean.x_train[:n])}, 1e-6,
          "lean rows as model inputs")


def _dataset_runs(raw: dict[str, Any]) -> None:
    from protofl.api import run_experiment

    run_experiment(config_from_dict({"algorithm": "fedavg", "rounds": 1, "seed": 0,
                                     "trainer": "sequential", "data": raw,
                                     "clients": {"per_round": 1, "local_steps": 1,
                                                 "batch_size": 8},
                                     "metrics": {"dissimilarity_clients": 0,
                                                 "train_loss_samples": 0, "every": 0}}))


def check_partition(partition: str | Callable[..., Any]) -> Report:
    """Check that a partition scheme (a name, an import path or the function ``(y,
    num_clients, rng, data_config) -> index arrays``) keeps protofl's contract; raises
    :class:`ConformanceError` naming each property that broke. The properties: ``valid``
    (for 1, 3 and 20 clients of 200 labels in 5 classes: one sorted, non-empty, disjoint
    array of indices per client), ``seeded`` (the same seed gives the same split) and
    ``runs`` (a FedAvg round on digits split by it)."""
    from protofl.config import DataConfig
    from protofl.data.partition import config_partition

    name = _name(partition)
    report = Report(f"partition {name!r}")
    y = np.arange(200) % 5

    def split(k: int, seed: int = 0) -> list[np.ndarray]:
        return config_partition(y, DataConfig(partition=name, seed=seed, num_clients=k),
                                name, k)

    report.run("valid", lambda: [split(k) for k in (1, 3, 20)] and None)
    report.run("seeded", lambda: _need(all(np.array_equal(a, b) for a, b in zip(
        split(3), split(3))), "the same seed gives another split"))
    report.run("runs", lambda: _dataset_runs({"name": "digits", "num_clients": 4,
                                              "partition": name}))
    return report.raise_failures()
