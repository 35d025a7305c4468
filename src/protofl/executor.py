"""Where a suite's runs run: ``local`` (a pool of processes on this machine's cores) or
``ray`` (each run a Ray task, on a Ray cluster: ``RAY_ADDRESS`` joins one, else Ray starts
one on this machine).

Both run the same function on each job, writing the same run folder, so a suite's folders,
tables and evidence, and its numbers, do not depend on the executor. Runs whose folder holds
``summary.json`` are done and skipped, so a suite stopped part-way picks up where it was. A
run whose Ray worker (or node) dies is re-run by Ray (``RETRIES`` times), from scratch, into
its folder (``overwrite``: a half-written folder is replaced). With ``ray`` every node must
see the suite's ``--out`` folder and the data at the same paths (one machine, or a shared
file system).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from protofl.errors import ProtoflError

EXECUTORS = ("local", "ray")
RETRIES = 3  # a Ray task lost with its worker or node is run again this many times
Job = tuple[dict, str]  # (raw config, run folder)


def run_one(args: tuple[dict, str, bool]) -> str:
    """One job: ``raw`` run into its folder (replacing what a lost try left there)."""
    raw, out, progress = args
    from protofl.api import run_experiment
    from protofl.config import config_from_dict

    # one thread and no worker processes of its own per run (the executor already spreads
    # the runs over every core)
    run_experiment(config_from_dict({"threads": 1, "workers": 1, **raw}), Path(out),
                   overwrite=True, progress=progress)
    return out


def phases(jobs: list[Job]) -> list[list[Job]]:
    """The jobs that other jobs read as their FFD reference, then the others."""
    refs = {Path(raw["metrics"]["ffd_reference"]).resolve() for raw, _ in jobs
            if raw.get("metrics", {}).get("ffd_reference")}
    first = [j for j in jobs if Path(j[1]).resolve() in refs]
    return [p for p in (first, [j for j in jobs if j not in first]) if p]


def execute(work: list[Job], jobs: int | None, desc: str, executor: str = "local") -> None:
    """Run every job of ``work`` not finished yet (FFD references first), with a progress
    bar: in ``jobs`` local processes, or as Ray tasks (``executor``)."""
    from tqdm import tqdm

    if executor not in EXECUTORS:
        raise ProtoflError(f"--executor {executor!r}: allowed {', '.join(EXECUTORS)}")
    todo = [(raw, folder) for raw, folder in work if not (Path(folder) / "summary.json").exists()]
    with tqdm(total=len(work), initial=len(work) - len(todo), unit="run", desc=desc) as bar:
        if executor == "ray":
            _on_ray(todo, jobs, bar)
        else:
            _locally(todo, jobs, bar)


def _locally(todo: list[Job], jobs: int | None, bar: Any) -> None:
    from multiprocessing import get_context

    jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo) or 1))
    if jobs == 1:
        for raw, folder in todo:
            run_one((raw, folder, False))
            bar.update(1)
        return
    with get_context("spawn").Pool(jobs) as pool:
        for phase in phases(todo):  # FFD references before the runs that read them
            for _ in pool.imap_unordered(run_one, [(r, f, False) for r, f in phase]):
                bar.update(1)


def resources(raw: dict) -> dict[str, float]:
    """A run's Ray resources: one CPU (``run_one`` trains on one thread), and a GPU when its
    device is CUDA."""
    device = str(raw.get("device") or "auto")
    return {"num_cpus": 1, "num_gpus": 1 if device.startswith("cuda") else 0}


def _on_ray(todo: list[Job], jobs: int | None, bar: Any) -> None:
    """Each job a Ray task on the cluster ``RAY_ADDRESS`` names (else a local one of ``jobs``
    CPUs); a lost task is run again, a run that fails stops the suite in one line."""
    try:
        import ray
    except ImportError:
        raise ProtoflError("--executor ray needs Ray (pip install 'protofl[flower]', which "
                           "brings flwr[simulation] and ray)") from None
    started = not ray.is_initialized()
    if started:
        address = os.environ.get("RAY_ADDRESS") or None
        try:
            ray.init(address=address, **({} if address else {"num_cpus": jobs or None}),
                     include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": _env()})
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ProtoflError(f"--executor ray: cannot reach the Ray cluster "
                               f"{address or '(local)'}: {str(e).splitlines()[0]}") from None
    task = ray.remote(max_retries=RETRIES, retry_exceptions=False)(run_one)
    try:
        for phase in phases(todo):
            pending = {task.options(**resources(raw)).remote((raw, folder, False)): folder
                       for raw, folder in phase}
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                folder = pending.pop(done[0])
                try:
                    ray.get(done[0])
                except Exception as e:  # noqa: BLE001 - a run's error, or its retries spent
                    for ref in pending:
                        ray.cancel(ref)
                    raise ProtoflError(f"suite run {folder} failed on Ray: "
                                       f"{_reason(e)}") from None
                bar.update(1)
    finally:
        if started:
            ray.shutdown()


def _env() -> dict[str, str]:
    """What a run's Ray worker needs of this process's environment (where protofl and its
    data caches are)."""
    keys = ("PYTHONPATH", "PROTOFL_CACHE", "PROTOFL_DATA", "PROTOFL_MEMORY_MB")
    return {k: os.environ[k] for k in keys if os.environ.get(k)}


def _reason(e: Exception) -> str:
    """The last line of a Ray task's error (Ray wraps it in the task's traceback)."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return (lines[-1] if lines else type(e).__name__)[:300]
