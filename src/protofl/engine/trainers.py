"""The trainers protofl has, and the one rule that picks one for each round.

A trainer is registered here by name and import path (``module:Class``), so reading the
registry imports no trainer. A trainer class has a ``name``, a one-line ``description``, a
static ``unable(model, precision, device) -> str | None`` (why it cannot train that model,
or None) and a method ``estimate(work: costs.Work) -> float``: the seconds the cost model
(``engine/costs.py``) gives its local training of a round. Adding a trainer is one file and
one line in :data:`TRAINERS`.

``trainer: auto`` is :class:`Auto`: every round it asks each trainer that can train the
model for its estimate of *that round's* work (each active client's steps, the batch, the
model's FLOPs) and trains the round with the cheapest (estimates within 5% are a tie, won by
the simplest trainer). A balanced round of many clients goes
to the vectorized (or compiled) trainer, a heavy-tailed one where one client holds most of
the steps to the parallel trainer (the long client on one core, the others beside it; or,
where the model's step is faster on several threads, the long client first on every core and
the others spread after it) or to the compiled step. The estimates read the costs calibrated on
this machine (``engine/calibrate.py``; the constants of ``engine/costs.py`` with
``calibrate: false``). A run records the trainer of every round and the calibration in its
folder (``plan.jsonl``); ``--resume`` and ``trainer_plan: <run folder>`` replay that plan, so
a run's numbers repeat bit for bit.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import multiprocessing
import os
from typing import Any

import torch
from torch import nn

from protofl import plugins
from protofl.engine import costs, hetero
from protofl.engine.train import ClientResult, RoundContext, Trainer, round_work
from protofl.errors import ProtoflError
from protofl.models.nets import ProtoNet

log = logging.getLogger("protofl")

TRAINERS: dict[str, str] = {
    "sequential": "protofl.engine.train:SequentialTrainer",
    "vectorized": "protofl.engine.vectorized:VectorizedTrainer",
    "compiled": "protofl.engine.compiled:CompiledTrainer",
    "parallel": "protofl.engine.parallel:ParallelTrainer",
}
IN_PROCESS = ("sequential", "vectorized", "compiled")  # one process, the run's threads
CHOICES = ("auto", *TRAINERS)


def trainer_class(name: str) -> type:
    """The trainer class ``name`` stands for: built in, an installed entry point
    (``protofl.trainers``) or an import path."""
    if name in TRAINERS:
        module, cls = TRAINERS[name].split(":")
        return getattr(importlib.import_module(module), cls)
    if name not in plugins.entry_points("trainer") and not plugins.is_path(name):
        raise ProtoflError(f"config: trainer = {name!r} is not a trainer; one of "
                           f"{', '.join(CHOICES)}, or an import path package.module:Class")
    cls = plugins.load("trainer", name, TRAINERS)
    missing = [m for m in ("name", "train", "unable", "estimate") if not hasattr(cls, m)]
    if not isinstance(cls, type) or missing:
        raise ProtoflError(f"trainer {name!r} is not a trainer class (it lacks "
                           f"{', '.join(missing) or 'a class'}; docs/architecture.md)")
    return cls


def describe() -> dict[str, str]:
    """Each trainer's one line (``auto`` first)."""
    return {"auto": Auto.description,
            **{n: trainer_class(n).description for n in TRAINERS}}


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def resolve_workers(workers: int | None) -> int:
    """``workers: auto`` (None) is every usable core; more than that is capped to it, with a
    warning (a process per job beyond the cores only thrashes the machine)."""
    cores = usable_cores()
    if workers and workers > cores:
        log.warning("workers = %d exceeds the %d usable CPU cores; using %d", workers, cores,
                    cores)
        return cores
    return workers or cores


def may_start_processes() -> bool:
    """False inside a daemonic process (a suite's pool worker), which cannot have children."""
    return not multiprocessing.current_process().daemon


def has_dropout(model: nn.Module) -> bool:
    """Dropout draws from the global generator, which differs between processes."""
    return any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules())


def parallel_reason(model: ProtoNet, device: torch.device, workers: int) -> str | None:
    """None when the parallel trainer may train ``model``; else why not."""
    if device.type != "cpu":
        return f"the parallel trainer spreads clients over CPU processes, not {device}"
    if not may_start_processes():
        return "the parallel trainer cannot start worker processes inside a daemonic process"
    if workers < 2:
        return "the parallel trainer needs at least 2 workers"
    if has_dropout(model):
        return "dropout draws from each process's own generator"
    return None


def make(name: str, model: ProtoNet, device: torch.device | str = "cpu", workers: int = 1,
         precision: str = "fp32", rounds: int = 1, calibrate: bool = False,
         plan: Plan | None = None) -> Trainer:
    """The trainer a config's ``trainer`` asks for. A named trainer that cannot train the
    model falls back to the sequential one, saying why (``parallel`` on a GPU or inside a
    daemonic process is an error instead); ``auto`` is :class:`Auto` (``calibrate``,
    ``plan``: its own)."""
    device = torch.device(device)
    if name == "auto":
        return Auto(model, device, workers, precision, rounds, calibrate=calibrate, plan=plan)
    cls = trainer_class(name)
    if name == "parallel":
        reason = parallel_reason(model, device, max(workers, 2))
        if reason is not None:
            raise ProtoflError(f"config: trainer = 'parallel': {reason}; use auto")
        return cls(workers, "auto", rounds=rounds)
    reason = cls.unable(model, precision, device)
    if reason is not None:
        log.info("training sequentially: %s", reason)
        return trainer_class("sequential")()
    return cls()


def candidates(model: ProtoNet, device: torch.device, workers: int, precision: str,
               rounds: int = 1, names: tuple[str, ...] = tuple(TRAINERS)) -> dict[str, Any]:
    """One instance of each trainer in ``names`` that can train ``model`` (in a run of
    ``rounds`` rounds)."""
    out: dict[str, Any] = {}
    for name in names:
        cls = trainer_class(name)
        if name == "parallel":
            if parallel_reason(model, device, workers) is None:
                out[name] = cls(workers, "auto", rounds=rounds)
        elif cls.unable(model, precision, device) is None:
            out[name] = cls()
    return out


def rounds_by_trainer(trainer: Trainer) -> dict[str, dict[str, int]]:
    """``{"trainer_rounds": {name: rounds}}`` for a run trained by :class:`Auto` (else {})."""
    chosen = getattr(_unwrapped(trainer), "chosen", None)
    if not chosen:
        return {}
    return {"trainer_rounds": {n: chosen.count(n) for n in dict.fromkeys(chosen)}}


COMPILE_SHARE = 0.5  # a calibration compiles where that is under this share of the run
CLOSE = 0.05  # estimates within 5% of each other are a tie: the constants are not finer


def cheapest(trainers: dict[str, Any], work: costs.Work) -> str:
    """The first registered trainer (the simplest: sequential, vectorized, compiled,
    parallel) whose estimate for ``work`` is within ``CLOSE`` of the least. A near tie never
    buys a compile: on the real MNIST protocol a lone client of 3,500 LEAF CNN steps was
    estimated 1.6% cheaper compiled, and its compile took minutes."""
    seconds = {n: t.estimate(work) for n, t in trainers.items()}
    least = min(seconds.values())
    return next(n for n, s in seconds.items() if s <= least * (1 + CLOSE))


class Auto:
    """``trainer: auto``: each round trained by the trainer with the least estimated cost
    for that round's work (``cheapest``), among those that can train the model.

    ``in_process`` keeps to one process (what the parallel trainer's workers run). A
    heterogeneous federation's rounds go to the parallel trainer whole (its workers split
    them by model group) or to an in-process trainer one group at a time.

    With ``calibrate`` the estimates read the costs measured on this machine
    (``engine/calibrate.py``, at the first round), else the constants. ``plan`` (a recorded
    :class:`Plan`) fixes the trainer of the rounds it holds and, past them, the costs."""

    name = "auto"
    description = ("each round trained by the trainer the cost model finds cheapest for "
                   "that round's work (costs measured on this machine: engine/calibrate.py)")
    groups_inside = True

    def __init__(self, model: ProtoNet, device: torch.device | str = "cpu", workers: int = 1,
                 precision: str = "fp32", rounds: int = 1, in_process: bool = False,
                 calibrate: bool = False, plan: Plan | None = None):
        from protofl.engine import calibrate as cal

        device = torch.device(device)
        names = IN_PROCESS if in_process else tuple(TRAINERS)
        self.trainers = candidates(model, device, workers, precision, rounds, names)
        self.rounds = rounds
        self.chosen: list[str] = []  # the trainer of each round trained, in order
        self.calibrate = cal.enabled(calibrate)
        self.replay(plan or Plan())

    def replay(self, plan: Plan) -> None:
        """Train the rounds ``plan`` holds with its trainers, and choose past them with its
        costs (no calibration when it has rounds)."""
        self.plan = plan
        self.table, self.calibration = plan.table, plan.calibration
        if plan.rounds:
            self.calibrate = False

    def work(self, rc: RoundContext) -> costs.Work:
        work = round_work(rc, rounds_left=max(1, self.rounds - rc.round + 1))
        return dataclasses.replace(work, table=self.table)

    def worth_compiling(self, rc: RoundContext) -> bool:
        """Whether a calibration should time the compiled step (a compile): where the
        constants' compile is under ``COMPILE_SHARE`` of the run's estimated training by the
        other trainers, so that it may pay."""
        if "compiled" not in self.trainers:
            return False
        work = round_work(rc, rounds_left=max(1, self.rounds - rc.round + 1))
        others = min((t.estimate(work) for n, t in self.trainers.items() if n != "compiled"),
                     default=0.0)
        return work.constants()["compile"] < COMPILE_SHARE * others * work.rounds_left

    def choose(self, rc: RoundContext) -> str:
        name = self.plan.rounds.get(rc.round)
        if name is None:
            return cheapest(self.trainers, self.work(rc))
        if name not in self.trainers:
            raise ProtoflError(f"trainer_plan: round {rc.round} was trained by {name!r}, which "
                               f"cannot train this run here (it has {', '.join(self.trainers)})")
        return name

    def train(self, rc: RoundContext) -> list[ClientResult]:
        if not rc.jobs:
            return []
        if self.calibrate:
            from protofl.engine import calibrate as cal

            self.calibrate = False  # once: the first round's model, data and setup
            if hetero.groups_of(rc.alg) is None:  # a heterogeneous run keeps the constants
                self.table, self.calibration = cal.costs_for(
                    rc, list(self.trainers), compile=self.worth_compiling(rc),
                    compiled=self.trainers.get("compiled"))
        name = self.choose(rc)
        self.chosen.append(name)
        trainer = self.trainers[name]
        if name != "parallel":
            trainer = hetero.grouped(trainer, rc.alg)
        return trainer.train(rc)

    def close(self) -> None:
        for t in self.trainers.values():
            if hasattr(t, "close"):
                t.close()


@dataclasses.dataclass
class Plan:
    """A run's record of its trainers: the trainer of each round (by round) and the
    calibration its choices read (its hash and cost table; None: the constants)."""

    rounds: dict[int, str] = dataclasses.field(default_factory=dict)
    calibration: str | None = None
    table: dict[str, float] | None = None


def replay(trainer: Any, plan: Plan) -> None:
    """``trainer`` (an :class:`Auto`, perhaps grouped) replays a resumed run's ``plan``, its
    costs and nothing measured anew; other trainers have no plan."""
    inner = _unwrapped(trainer)
    if isinstance(inner, Auto):
        inner.replay(plan)
        inner.calibrate = False


def _unwrapped(trainer: Any) -> Any:
    """The trainer a model-group wrapper (``hetero.grouped``) holds, else ``trainer`` itself
    (the parallel trainer's ``inner`` is the name of its workers' trainer, not a wrapper's)."""
    inner = getattr(trainer, "inner", trainer)
    return trainer if isinstance(inner, str) else inner


def last_choice(trainer: Any) -> tuple[str, str | None, dict[str, float] | None]:
    """The trainer of the round ``trainer`` trained last, and the calibration's hash and cost
    table the choice read (a named trainer: its name, None, None)."""
    inner = _unwrapped(trainer)
    chosen = getattr(inner, "chosen", None)
    if chosen:
        return chosen[-1], inner.calibration, inner.table
    return inner.name, None, None
