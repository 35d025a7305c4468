"""Trainer costs measured on this machine: what ``trainer: auto`` reads in place of
``engine/costs.py``'s constants (like FFTW's wisdom).

A calibration times, on the run's own algorithm, data, batch and device, a few short rounds of
each in-process trainer that can train the model (``STEPS`` local steps each): the plain step
(the sequential trainer, one client), the vmap step at 1 and ``CLIENTS`` clients (the vectorized
trainer), the compiled step at the round's own clients and its compile (the compiled trainer,
where a compile may pay: ``protofl calibrate``, or a run whose constants put the compile under
half its training; else its cost is the vmap step's scaled by the constants' ratio), and the
plain step on every usable core (the parallel trainer's lead). A run's calibration compiles
with the run's own compiled trainer, so the graph it compiles is the one the run's first
compiled round uses: a first run pays one compile, not two. Each round runs three times and the
fastest counts, in the process's CPU time on a CPU (wall clock for the plain step on every
core, a compile and on CUDA), so that a busy machine's other processes do not enter the
costs; torch's global generator is left as it was. It becomes a cost table in the form of
``costs.CPU`` with the arithmetic folded into the overheads (``rate`` infinite: the key fixes
the model and batch); starting processes and their messages keep the constants.

The table is kept in ``<protofl cache>/calibration/<key>.json`` (written atomically), the key
a hash of the machine (CPU or GPU model, usable cores, torch threads, torch version) and the
model's signature (its class, parameter shapes, input shape, batch, algorithm, precision,
device). ``trainer: auto`` measures once per key unless ``calibrate: false`` (or
``$PROTOFL_CALIBRATE=0``, which the test suite sets); ``protofl calibrate`` measures again.
A damaged entry is reported in one line and the constants are used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from protofl.data import store
from protofl.engine import costs
from protofl.engine.schedule import Job
from protofl.engine.train import RoundContext

log = logging.getLogger("protofl")

ENV = "PROTOFL_CALIBRATE"  # "0": never calibrate (the constants decide)
FOLDER = "calibration"
VERSION = 2  # 2: the compiled window a loop on a CPU (its costs measured anew)
STEPS = costs.COMPILED_STEPS  # local steps of each timed round (one compiled window)
REPEATS = 3  # rounds timed of each; the fastest counts
CLIENTS = 8  # clients of the larger timed vmap and compiled rounds (a power of two)


def enabled(calibrate: bool) -> bool:
    """Whether ``auto`` may calibrate: the config's ``calibrate`` and ``$PROTOFL_CALIBRATE``."""
    return calibrate and os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no")


def folder() -> Path:
    return store.cache_home() / FOLDER


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device) -> dict[str, Any]:
    """What of this machine a calibration holds for."""
    from protofl.engine.trainers import usable_cores

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"cpu": cpu_model(), "gpu": gpu, "cores": usable_cores(),
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def signature(rc: RoundContext) -> dict[str, Any]:
    """What of the run a calibration holds for: its model, input, batch and algorithm."""
    model = rc.alg.model
    x1 = rc.data.inputs(rc.data.x_train[:1])
    return {"model": type(model).__name__,
            "params": [[k, list(v.shape)] for k, v in model.state_dict().items()],
            "input": list(x1.shape[1:]), "dtype": str(x1.dtype),
            "batch": rc.setup.batch_size, "algorithm": rc.alg.name,
            "precision": rc.setup.precision, "device": torch.device(rc.setup.device).type}


def key_of(mach: dict, sig: dict) -> str:
    blob = json.dumps({"version": VERSION, "machine": mach, "model": sig}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def digest(measured: dict[str, float]) -> str:
    """A calibration's hash (what a run records): of its measured costs."""
    return hashlib.sha256(json.dumps(measured, sort_keys=True).encode()).hexdigest()[:16]


def table(measured: dict[str, float], device: str) -> dict[str, float]:
    """The cost table of a calibration: its measured costs over the device's constants, the
    arithmetic folded in (``rate`` infinite)."""
    base = costs.CUDA if device == "cuda" else costs.CPU
    return {**base, **measured, "rate": math.inf}


def load(key: str) -> dict[str, float] | None:
    """The measured costs of ``key``; None when there are none. A damaged entry is one
    warning line (and None)."""
    path = folder() / f"{key}.json"
    try:
        entry = json.loads(path.read_bytes())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as e:
        log.warning("calibration %s cannot be read (%s); auto uses the fixed cost constants "
                    "(`protofl calibrate` measures again)", path, type(e).__name__)
        return None
    measured = entry.get("measured") if isinstance(entry, dict) else None
    if (not isinstance(measured, dict) or entry.get("version") != VERSION or not all(
            isinstance(v, int | float) and math.isfinite(v) for v in measured.values())):
        log.warning("calibration %s is damaged or of another version; auto uses the fixed "
                    "cost constants (`protofl calibrate` measures again)", path)
        return None
    return {k: float(v) for k, v in measured.items()}


def save(key: str, mach: dict, sig: dict, measured: dict[str, float], seconds: float) -> Path:
    """Write a calibration atomically (a temporary file renamed into place)."""
    path = folder() / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"version": VERSION, "key": key, "machine": mach, "model": sig,
             "measured": measured, "digest": digest(measured), "seconds": round(seconds, 2),
             "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entry, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def _round(rc: RoundContext, clients: list[int], steps: int = STEPS) -> RoundContext:
    """``rc``'s round with ``clients`` each taking ``steps`` steps, nothing sent anywhere."""
    setup = dataclasses.replace(rc.setup, by_steps=True, lr_decay=1.0)
    return dataclasses.replace(rc, jobs=[Job(int(k), steps) for k in clients], setup=setup,
                               client_states={}, upload_hook=None)


def _timed(trainer: Any, rc: RoundContext, wall: bool = False) -> tuple[float, float]:
    """Seconds of the first of ``REPEATS`` rounds of ``trainer`` on ``rc`` (wall clock: a
    compile's included) and of the fastest. On a CPU the fastest is the process's CPU time
    (unless ``wall``), so that other processes' load is not measured: the costs are the
    machine's, not the moment's; on CUDA it is the wall clock, the device synchronized."""
    cuda = torch.device(rc.setup.device).type == "cuda"
    clock = time.perf_counter if wall or cuda else time.process_time
    first, best = 0.0, math.inf
    for _ in range(REPEATS):
        start, used = time.perf_counter(), clock()
        trainer.train(rc)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, clock() - used)
        first = first or time.perf_counter() - start
    return first, best


def measure(rc: RoundContext, names: list[str], compile: bool = False,
            compiled: Any = None) -> dict[str, float]:
    """The costs of the trainers ``names`` (of ``trainers.TRAINERS``) on ``rc``'s algorithm,
    data and setup, per step (seconds); the keys of ``costs.CPU`` they determine. The
    compiled step is timed with ``compile`` (a compile: seconds on a CPU when torch's
    cache does not hold the graph), on ``compiled`` (a ``CompiledTrainer``, which keeps the
    graph; default a new one) at ``rc``'s clients (``CLIENTS`` when it has none); else its
    cost per client is the vmap step's, scaled by the constants' ratio of the two."""
    from protofl.engine.compiled import CompiledTrainer, window_limit
    from protofl.engine.train import SequentialTrainer
    from protofl.engine.trainers import usable_cores
    from protofl.engine.vectorized import VectorizedTrainer

    sizes = np.asarray(rc.data.train_sizes)
    order = [int(k) for k in np.argsort(-sizes, kind="stable") if sizes[k] > 0]
    n = min(CLIENTS, len(order))
    one, many = _round(rc, order[:1]), _round(rc, order[:n])
    base = costs.CUDA if torch.device(rc.setup.device).type == "cuda" else costs.CPU
    out: dict[str, float] = {}
    devs = [torch.cuda.current_device()] if torch.device(rc.setup.device).type == "cuda" else []
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=devs):
        out["plain"] = _timed(SequentialTrainer(), one)[1] / STEPS
        cores = usable_cores()
        if "parallel" in names and cores > 1:
            narrow = _timed(SequentialTrainer(), one, wall=True)[1]
            torch.set_num_threads(cores)
            try:
                wide = _timed(SequentialTrainer(), one, wall=True)[1]
            finally:
                torch.set_num_threads(threads)
            # the plain step's speed-up on every core, on the wall clock
            out["thread_sync"] = out["plain"] * (wide / narrow - 1) / (cores - 1)
            out["thread_gain"] = 0.0
        if n > 1 and ("vectorized" in names or "compiled" in names):
            v1 = _timed(VectorizedTrainer(solo_max=0), one)[1] / STEPS
            vn = _timed(VectorizedTrainer(solo_max=0), many)[1] / STEPS
            out["vmap_client"] = max((vn - v1) / (n - 1), 0.0)
            out["vmap"] = max(v1 - out["vmap_client"], 0.0)
        if n > 1 and "compiled" in names and compile:
            # one window of the round's own: its clients, as many steps as its graphs take
            longest = max((costs.job_steps(j, rc.data, rc.setup.batch_size, rc.setup.by_steps)
                           for j in rc.jobs), default=STEPS)
            w = costs.window(longest, window_limit(rc.setup.device))
            whole = _round(rc, [j.client for j in rc.jobs] or order[:n], w)
            first, best = _timed(compiled or CompiledTrainer(), whole)
            out["compiled"] = base["compiled"]
            out["compiled_client"] = max((best - base["compiled"]) / w / len(whole.jobs), 0.0)
            out["compile"] = max(first - best, 0.0)
        elif "vmap_client" in out and "compiled" in names:
            arithmetic = costs.Work.of(rc.alg.model, rc.data.inputs(rc.data.x_train[:1]),
                                       rc.setup.batch_size, rc.setup.device, [1]).arithmetic()
            ratio = ((base["compiled_client"] + arithmetic)
                     / (base["vmap_client"] + arithmetic))
            out["compiled_client"] = out["vmap_client"] * ratio
    return out


def costs_for(rc: RoundContext, names: list[str], remeasure: bool = False,
              compile: bool = False, compiled: Any = None
              ) -> tuple[dict[str, float] | None, str | None]:
    """The cost table and calibration hash for ``rc``'s model on this machine: the cached
    calibration, else (or with ``remeasure``) one measured now (``compile``, ``compiled``:
    ``measure``'s) and cached; ``(None, None)`` when a damaged entry or an unwritable cache
    leaves only the constants."""
    device = torch.device(rc.setup.device)
    mach, sig = machine(device), signature(rc)
    key = key_of(mach, sig)
    path = folder() / f"{key}.json"
    measured = None if remeasure else load(key)
    if measured is None and not remeasure and path.exists():
        return None, None  # damaged: said by load
    if measured is not None and compile and "compile" not in measured:
        measured = None  # timed without its compile: a run that may pay for it times it
    if measured is None:
        log.warning("calibrating the trainers for %s at batch %d on this machine (once; "
                    "calibrate: false skips it)", sig["model"], sig["batch"])
        start = time.perf_counter()
        try:
            measured = measure(rc, names, compile, compiled)
            save(key, mach, sig, measured, time.perf_counter() - start)
        except OSError as e:
            log.warning("calibration cannot be cached in %s (%s); auto uses the fixed cost "
                        "constants", path.parent, e.strerror or e)
            return None, None
    return table(measured, device.type), digest(measured)


def entries() -> list[tuple[Path, dict | None]]:
    """The cached calibrations (None: unreadable)."""
    out: list[tuple[Path, dict | None]] = []
    for path in sorted(folder().glob("*.json")):
        try:
            out.append((path, json.loads(path.read_bytes())))
        except (OSError, ValueError):
            out.append((path, None))
    return out


def calibrate_config(cfg: Any, compile: bool = True) -> list[str]:
    """``protofl calibrate``: measure (again) the trainers' costs for the run ``cfg``
    configures (``compile``: the compiled step too), cache them, and say what they are."""
    from protofl.engine import hetero, trainers
    from protofl.engine.experiment import Experiment
    from protofl.errors import ProtoflError

    exp = Experiment(cfg, callbacks=[])
    spec = exp.cfg
    if hetero.groups_of(exp.alg) is not None:
        raise ProtoflError("calibrate: a heterogeneous run's trainer choices read the fixed "
                           "constants; nothing to calibrate")
    names = list(trainers.candidates(exp.alg.model, exp.device, spec.workers, spec.precision,
                                     spec.rounds))
    rc = RoundContext(exp.alg, exp.alg.broadcast(exp.state), exp.jobs(1)[1], exp.train_data,
                      {}, exp.setup.at(1), 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        start = time.perf_counter()
        found, hashed = costs_for(rc, names, remeasure=True, compile=compile)
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
        exp.close()
    if found is None:
        raise ProtoflError(f"calibrate: the costs could not be cached in {folder()}")
    sig = signature(rc)
    shown = ", ".join(f"{k} {found[k] * 1e6:.0f} us" for k in (
        "plain", "vmap", "vmap_client", "compiled_client") if k in found)
    lines = [f"calibrated {sig['model']} at batch {sig['batch']} ({sig['algorithm']}, "
             f"{sig['device']}) in {seconds:.1f} s: {shown}"]
    if compile and "compiled" in names:
        lines.append(f"compile of one stack size: {found['compile']:.1f} s")
    key = key_of(machine(torch.device(rc.setup.device)), sig)
    lines.append(f"calibration {hashed} in {folder() / (key + '.json')}")
    return lines
