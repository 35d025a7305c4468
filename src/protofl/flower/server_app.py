"""The ServerApp: protofl's round loop with Flower SuperNodes as the trainers.

The server is ``protofl.engine.experiment.Experiment`` (same sampling, stragglers,
aggregation, evaluation, AMM, run folder) given a :class:`FlowerTrainer`, which instead of
training in process sends each job to the SuperNode holding that client's partition and turns
the replies back into ``ClientResult``s. An error reply (node died), a missing reply or an
unreadable record is logged with the node and the problem and left out; the engine then
checks every upload as it checks in-process ones (``Experiment.screen``: missing keys, wrong
shapes, NaN/Inf, negative counts). The round goes on with the rest, and a round with no valid
reply keeps the previous global state.

Client-side state never reaches the server: for personalised methods each node scores its
own model on its local test split and the server adds up the nodes' confusion matrices (the
engine's figures, except training loss and gradient dissimilarity, which need the weights).

Site mode (``data.name: site``, ``data/site.py``): the server holds no training data. When
the run starts each node loads its own files and reports its sample counts (the weights of
``weighted`` client sampling, checkpointed so that a resumed run samples as before); a node
whose files do not fit the agreed classes or input shape replies with an error and is left
out. Every evaluation is federated (each site scores the model on its held-out split, the
server adds up the counts), plus a central one where the server has a test set.

A run resumes (run config ``resume=true``) from the checkpoint of its run folder ``out``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from logging import ERROR, INFO
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.common.logger import log as flwr_log
from flwr.serverapp import Grid, ServerApp

from protofl.algorithms.capabilities import personalized
from protofl.api import folder_callbacks
from protofl.config import Config
from protofl.data.site import SiteFederation
from protofl.engine.callbacks import Callback, EarlyStop, TestMetrics, metric_callbacks
from protofl.engine.experiment import Experiment
from protofl.engine.federation import build
from protofl.engine.runfolder import CONFIG, RunStore
from protofl.errors import ProtoflError
from protofl.flower.setup import OUT, config_from_run
from protofl.flower.trainer import FlowerTrainer, short, transport  # noqa: F401 (re-exported)
from protofl.metrics.sites import pooled_figures
from protofl.nested import flatten
from protofl.report.runs import summary_line

log = logging.getLogger("protofl.flower")

ROUND_TIMEOUT = "round-timeout"  # seconds to wait for a round's replies
NODE_WAIT = "node-wait"  # seconds to wait for every client's SuperNode to connect
RESUME = "resume"  # continue the run in `out` from its last checkpoint
MIN_REPLIES = "min-replies"  # fewer valid replies: the round once more, then the run stops
LOG_FILE = "flower.log"


FEDERATED = ("accuracy", "loss")  # site mode: logged as federated_accuracy, federated_loss
PER_SITE = ("local_accuracy", "client_accuracy", "client_accuracy_std", "client_accuracy_worst10",
            "clients_evaluated")  # only sites know them


class RemoteTestMetrics(TestMetrics):
    """The engine's test metrics, with the nodes' scores where the server lacks the data or
    the models: for personalised methods, and in site mode, each node scores its model on its
    held-out split and the server adds the counts up (``metrics/sites.py``). In site mode the
    figures without prefix are the server's own test set's when it has one and the model is
    global, else the sites' pooled ones; ``federated_accuracy`` / ``federated_loss`` are
    always the sites'."""

    def __init__(self, trainer: FlowerTrainer):
        self.trainer = trainer

    def on_evaluate(self, exp, record):
        sites = isinstance(exp.data, SiteFederation)
        if not personalized(exp.alg):
            super().on_evaluate(exp, record)  # the engine's (site mode: the server's test set)
            if not sites:
                return
        pooled = pooled_figures(self.trainer.evaluations(exp.state, exp.round))
        if not pooled:
            record.setdefault("clients_evaluated", 0)
            return
        if not sites:  # personalised methods, as the engine scores them (no loss)
            pooled.pop("loss")
        else:
            record.update({f"federated_{k}": pooled[k] for k in FEDERATED})
            record.update({k: pooled[k] for k in PER_SITE})  # the server's data have no sites
        for k, v in pooled.items():  # a central evaluation's figures, where it made them, win
            record.setdefault(k, v)


class StreamWarnings(logging.Handler):
    """protofl's warnings (a node left out, a round sent again) into Flower's log, which
    ``flwr run --stream`` and ``flwr log`` show, not only into ``flower.log``."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "stream", True):
            flwr_log(record.levelno, "protofl: %s", record.getMessage())


def run_on_grid(cfg: Config, grid: Grid, out: Path | None = None, round_timeout: float = 600.0,
                node_wait: float = 120.0, resume: bool = False,
                callbacks: Sequence[Callback] = (), min_replies: int = 1) -> Experiment:
    """Run ``cfg`` to the end on the SuperNodes of ``grid``; writes the run folder ``out``
    (config.json, metrics.jsonl, checkpoints, summary.json, plots) as the in-process engine
    does, plus ``flower.log``: the server's log lines (left-out replies, missing nodes), whose
    warnings also go to Flower's log. With ``resume`` a run folder holding a run continues
    from its checkpoint (:func:`restore`); an empty or missing one starts the run.
    ``callbacks`` are added to the run's; ``min_replies`` is the round policy
    (``FlowerTrainer``)."""
    stream = StreamWarnings()
    engine_log = logging.getLogger("protofl")
    engine_log.addHandler(stream)
    try:
        return _run_on_grid(cfg, grid, out, round_timeout, node_wait, resume, callbacks,
                            min_replies)
    finally:
        engine_log.removeHandler(stream)


def _run_on_grid(cfg: Config, grid: Grid, out: Path | None, round_timeout: float,
                 node_wait: float, resume: bool, callbacks: Sequence[Callback],
                 min_replies: int) -> Experiment:
    from protofl.flower.secure import trainer_for  # privacy.secagg: SecAgg+ rounds

    trainer = trainer_for(cfg, grid, round_timeout, node_wait, min_replies)
    metrics = [RemoteTestMetrics(trainer) if isinstance(cb, TestMetrics) else cb
               for cb in metric_callbacks()]
    store = RunStore(out) if out is not None else None
    # the store prepares the run folder before the trainer's on_run_start logs anything into it
    exp = Experiment(build(cfg, holds_clients=False), trainer=trainer, store=store, callbacks=[
        *metrics, *folder_callbacks(out, progress=False), trainer, *callbacks])
    if exp.cfg.data.pooled:
        raise ProtoflError(f"flower: {exp.alg.name} trains on the pooled data of every client, "
                           "which a federation never gathers; run it with `protofl run`")
    if personalized(exp.alg) and exp.fed.validation is not None:
        # its clients' models stay at their nodes: the server cannot score their validation rows
        if exp.cfg.metrics.early_stop:
            raise ProtoflError(f"flower: metrics.early_stop with {exp.alg.name}: each client's "
                               "model stays at its node, so the server cannot score the "
                               "validation split; run it with `protofl run`")
        exp.callbacks = [cb for cb in exp.callbacks if not isinstance(cb, EarlyStop)]
    if out is None:
        exp.run()
        return exp
    engine_log = logging.getLogger("protofl")  # the engine's and this module's lines
    with store.lock():
        held = store.held()
        if held - {LOG_FILE} and not resume:
            raise ProtoflError(f"flower: run folder {out} already holds a run; add "
                               "resume=true to the run config to continue it from its last "
                               "checkpoint, or choose another out")
        # only the log of a failed start, or (resume) a run stopped before its first
        # checkpoint: nothing to continue, so start afresh
        fresh = held == {LOG_FILE} or (resume and store.folder_state() == "no-checkpoint")
        store.overwrite = fresh
        handler = store.log_handler(LOG_FILE)  # opened at the first line
        engine_log.addHandler(handler)
        engine_log.setLevel(logging.INFO)
        try:
            if resume and not fresh and CONFIG in held:
                restore(exp, store)
            try:
                summary = exp.run()
            except ProtoflError as e:  # into flower.log too (serve() streams it)
                log.error("protofl: error: %s", e, extra={"stream": False})
                raise
            log.info("protofl run finished: %s", {k: summary.get(k) for k in (
                "algorithm", "dataset", "rounds", "accuracy")})
        finally:
            engine_log.removeHandler(handler)
            handler.close()
    return exp


def restore(exp: Experiment, store: RunStore | Path) -> None:
    """Put ``exp`` where the run of ``store``'s folder stopped: its last checkpoint (server
    state, client states the server holds, callbacks' state, RNG), after checking that
    ``exp``'s resolved config is the folder's (``rounds`` may grow) and that
    ``metrics.jsonl`` holds every evaluated round up to the checkpoint."""
    store = store if isinstance(store, RunStore) else RunStore(store)
    out = store.out
    if store.verify() is None:
        log.warning("%s has no manifest.json (written by protofl 0.1): its files cannot be "
                    "checked; it gets one now", out)
    stored = flatten(store.config())
    mine = flatten(json.loads(json.dumps(exp.cfg.to_dict())))  # as config.json holds it
    for key in sorted(set(stored) | set(mine)):
        if key != "rounds" and stored.get(key) != mine.get(key):
            raise ProtoflError(f"flower: cannot resume {out}: the run config gives {key} = "
                               f"{mine.get(key)!r}, the run was started with "
                               f"{stored.get(key)!r}; resume with the config it started with")
    exp.resume(store.checkpoint(), store)
    log.info("resuming %s after round %d of %d", out, exp.round, exp.cfg.rounds)


def make_server_app(cfg: Config | None = None, out: Path | None = None,
                    on_finish: Any = None, callbacks: Sequence[Callback] = ()) -> ServerApp:
    """A ServerApp for ``cfg`` (``None``: read the run config); ``on_finish(exp)`` is called
    with the finished Experiment (tests, notebooks); ``callbacks`` join the run's."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        exp = serve(grid, context, cfg, out, callbacks)
        if on_finish is not None:
            on_finish(exp)

    return app


def serve(grid: Grid, context: Context, cfg: Config | None = None, out: Path | None = None,
          callbacks: Sequence[Callback] = ()) -> Experiment:
    """The ServerApp's work: the run its run config (or ``cfg``) names, on ``grid``. Its
    result is logged as one line; a ProtoflError is logged as one line before it propagates
    (Flower then logs its traceback and marks the run failed)."""
    rc = context.run_config
    flwr_log(INFO, "protofl: %s", transport(grid))
    try:
        run_cfg = cfg if cfg is not None else config_from_run(rc)
        folder = out if out is not None or not rc.get(OUT) else Path(str(rc[OUT]))
        exp = run_on_grid(run_cfg, grid, folder, float(rc.get(ROUND_TIMEOUT, 600.0)),
                          float(rc.get(NODE_WAIT, 120.0)), resume_flag(rc.get(RESUME, False)),
                          callbacks, min_replies_of(rc.get(MIN_REPLIES, 1)))
    except ProtoflError as e:
        flwr_log(ERROR, "protofl: error: %s", e)
        raise
    flwr_log(INFO, "protofl: %s", summary_line(exp.summary(), folder))
    return exp


def min_replies_of(value: Any) -> int:
    """The run config's ``min-replies``: a whole number, at least 0."""
    try:
        n = int(str(value).strip())
    except ValueError:
        n = -1
    if n < 0:
        raise ProtoflError(f"flower: run config min-replies = {value!r}: allowed a whole "
                           "number >= 0 (0: a round aggregates whatever came)")
    return n


def resume_flag(value: Any) -> bool:
    """The run config's ``resume`` (a bool, or a string such as "true" from the command line)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", ""):
        return False
    raise ProtoflError(f"flower: run config resume = {value!r}: allowed true or false")


app = make_server_app()
