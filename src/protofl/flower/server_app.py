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
import re
import time
from collections.abc import Sequence
from logging import ERROR, INFO
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.logger import log as flwr_log
from flwr.serverapp import Grid, ServerApp

from protofl.algorithms.capabilities import personalized
from protofl.api import folder_callbacks
from protofl.config import Config
from protofl.data.site import SiteFederation
from protofl.engine.callbacks import Callback, RoundView, TestMetrics, metric_callbacks
from protofl.engine.experiment import Experiment
from protofl.engine.runfolder import CONFIG, RunStore
from protofl.engine.train import ClientResult, RoundContext
from protofl.errors import ProtoflError
from protofl.flower.link import superlink_args, transport_line
from protofl.flower.node import VERSIONS_RECORD, versions
from protofl.flower.records import tree_from_records, tree_to_records
from protofl.flower.setup import OUT, check_partitions, config_from_run
from protofl.metrics.sites import SiteScore, pooled_figures
from protofl.nested import flatten
from protofl.report.runs import summary_line

log = logging.getLogger("protofl.flower")

ROUND_TIMEOUT = "round-timeout"  # seconds to wait for a round's replies
NODE_WAIT = "node-wait"  # seconds to wait for every client's SuperNode to connect
RESUME = "resume"  # continue the run in `out` from its last checkpoint
POLL_S = 0.2
LOG_FILE = "flower.log"
_WRAPPED = re.compile(r"^<class '(?:[\w.]+\.)?(\w+)'>:<'(.*)'>$", re.S)


def short(reason: str) -> str:
    """One line of an error reply's reason: the last non-empty line (Ray wraps it in a
    traceback), ``Type: message`` for Flower's ``<class '...Type'>:<'message'>``."""
    text = str(reason).strip()
    m = _WRAPPED.match(text)
    if m:
        text = f"{m.group(1)}: {m.group(2)}"
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    return (lines[-1] if lines else "unknown error")[:300]


class FlowerTrainer(Callback):
    """A trainer (and round callback) whose clients are SuperNodes reached through a Flower
    ``Grid``: when the run starts it finds which node holds which client; each round's
    rejected clients are added to the metrics line."""

    name = "flower"

    def __init__(self, grid: Grid, round_timeout: float = 600.0, node_wait: float = 120.0):
        self.grid, self.round_timeout, self.node_wait = grid, round_timeout, node_wait
        self.nodes: dict[int, int] = {}
        self.sizes: dict[int, int] = {}  # site mode: training samples per site, as reported
        self.restored_sizes: np.ndarray | None = None  # site mode: from the checkpoint
        self.rejected: list[dict[str, Any]] = []
        self.cfg_json = ""
        self.versions: dict[str, str] = {}

    @property
    def sites(self) -> bool:
        """Site mode: the clients' data are on the nodes only."""
        return isinstance(self.exp.data, SiteFederation)

    def on_run_start(self, exp: RoundView) -> None:
        log.info("%s", transport(self.grid))  # flower.log's first line (after the folder's set-up)
        self.exp = exp  # the run's view: its spec, and the data whose sizes the sites report
        self.cfg_json = json.dumps(exp.cfg.to_dict(), sort_keys=True)
        self.versions = versions(self.cfg_json)  # sent with every query and job
        if self.sites and exp.private and exp.cfg.clients.sampling == "weighted":
            raise ProtoflError("flower: under privacy the sites keep their sample counts to "
                               "themselves, so clients.sampling = weighted cannot be met; set "
                               "clients.sampling: uniform")
        self.nodes = self.discover(self.node_wait)
        if self.sites:
            exp.data.set_sizes(self.site_sizes())

    # ---- which node holds which client ----
    def discover(self, wait: float) -> dict[int, int]:
        """Map client (partition-id) -> node id, asking every connected SuperNode; waits up
        to ``wait`` s for one node per client, then goes on with those it has. In site mode
        the query carries the run's config, and each node checks its files and reports its
        sizes; a node that cannot join replies with an error and is left out."""
        want = self.exp.data.num_clients
        deadline = time.monotonic() + wait
        nodes: dict[int, int] = {}
        asked: set[int] = set()
        query = {"what": "partition", **({"config": self.cfg_json} if self.sites else {})}
        while True:
            new = [n for n in self.grid.get_node_ids() if n not in asked]
            asked.update(new)
            msgs = [Message(RecordDict({"query": ConfigRecord(query),
                                        VERSIONS_RECORD: ConfigRecord(self.versions)}),
                            dst_node_id=n, message_type="query") for n in new]
            for reply in self._exchange(msgs, max(deadline - time.monotonic(), 5.0)):
                node = reply.metadata.src_node_id
                if reply.has_error():
                    reason = short(reply.error.reason)
                    log.warning("node %s %s: %s", node, "left out (it cannot join)"
                                if self.sites or "mismatch" in reason
                                else "did not describe itself", reason)
                    continue
                info = reply.content.config_records["node"]
                check_partitions(int(info["num-partitions"]), self.exp.data)
                pid = int(info["partition-id"])
                if not 0 <= pid < want:
                    raise ProtoflError(f"flower: node {node} has partition-id {pid}, outside "
                                       f"0..{want - 1}")
                if pid in nodes:
                    log.warning("nodes %s and %s both hold partition %s; using %s",
                                nodes[pid], node, pid, nodes[pid])
                    continue
                nodes[pid] = node
                if "num-examples" in info:
                    self.sizes[pid] = int(info["num-examples"])
                    log.info("site %d (node %s): %d training and %s held-out samples", pid,
                             node, self.sizes[pid], info.get("num-test"))
            if len(nodes) == want or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        missing = sorted(set(range(want)) - set(nodes))
        if missing:
            log.warning("no SuperNode for clients %s; they are skipped when sampled", missing)
        log.info("%d of %d clients have a SuperNode", len(nodes), want)
        return nodes

    def site_sizes(self) -> np.ndarray:
        """The sites' training sizes (client sampling): those in the checkpoint when the run
        resumes, else as reported, with the mean of the known ones for a site that did not
        join (it is sampled as usual and left out)."""
        if self.restored_sizes is not None:
            for k, n in self.sizes.items():
                if n != self.restored_sizes[k]:
                    log.warning("site %d now reports %d training samples, %d when the run "
                                "started; sampling keeps the first count", k, n,
                                self.restored_sizes[k])
            return self.restored_sizes
        if not self.sizes or sum(self.sizes.values()) == 0:
            raise ProtoflError(f"flower: no site joined within node-wait = {self.node_wait:g} "
                               "s with training samples (see flower.log for why)")
        fill = int(round(np.mean(list(self.sizes.values()))))
        return np.array([self.sizes.get(k, fill) for k in range(self.exp.data.num_clients)])

    def state_dict(self) -> dict[str, Any]:
        sized = self.sites and self.exp.data.sizes is not None
        return {"sizes": torch.from_numpy(self.exp.data.sizes)} if sized else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "sizes" in state:
            self.restored_sizes = state["sizes"].cpu().numpy().astype(np.int64)

    def _exchange(self, msgs: list[Message], timeout: float) -> list[Message]:
        """Push ``msgs``, pull replies until all came, their nodes left, or ``timeout``."""
        if not msgs:
            return []
        dst = {}
        for mid, m in zip(self.grid.push_messages(msgs), msgs):
            dst[mid] = m.metadata.dst_node_id
        replies: list[Message] = []
        deadline = time.monotonic() + timeout
        next_check = time.monotonic() + 2.0
        while dst and time.monotonic() < deadline:
            got = list(self.grid.pull_messages(list(dst)))
            for r in got:
                dst.pop(r.metadata.reply_to_message_id, None)
                replies.append(r)
            if dst and time.monotonic() > next_check:  # stop waiting for nodes that left
                alive = set(self.grid.get_node_ids())
                for mid, node in list(dst.items()):
                    if node not in alive:
                        log.warning("node %s left before replying", node)
                        dst.pop(mid)
                next_check = time.monotonic() + 2.0
            if dst and not got:
                time.sleep(POLL_S)
        for node in dst.values():
            log.warning("node %s did not reply within %.0f s", node, timeout)
        return replies

    # ---- the trainer ----
    def train(self, rc: RoundContext) -> list[ClientResult]:
        rnd = rc.round
        records = tree_to_records(rc.broadcast, "broadcast", RecordDict())
        msgs, sent = [], {}
        for job in rc.jobs:
            node = self.nodes.get(job.client)
            if node is None:
                self._reject(rnd, job.client, None, "no SuperNode holds this client")
                continue
            content = RecordDict({**records, "job": ConfigRecord({
                "round": rnd, "client": job.client, "units": job.units,
                "straggler": job.straggler, "config": self.cfg_json}),
                VERSIONS_RECORD: ConfigRecord(self.versions)})
            msgs.append(Message(content, dst_node_id=node, message_type="train",
                                group_id=str(rnd)))
            sent[node] = job.client
        results: dict[int, ClientResult] = {}
        for reply in self._exchange(msgs, self.round_timeout):
            node = reply.metadata.src_node_id
            client = sent.pop(node, None)
            if client is None:
                log.warning("round %d: reply from unexpected node %s ignored", rnd, node)
                continue
            if reply.has_error():
                self._reject(rnd, client, node, f"error reply: {short(reply.error.reason)}")
                continue
            try:
                upload = tree_from_records(reply.content, "upload")
                loss = float(reply.content.metric_records["metrics"]["loss"])
            except (ProtoflError, KeyError, TypeError, ValueError) as e:
                self._reject(rnd, client, node, str(e))
                continue
            results[client] = ClientResult(client, upload, {}, loss)
        for node, client in sent.items():  # what is left never replied
            self._reject(rnd, client, node, "no reply")
        return [results[j.client] for j in rc.jobs if j.client in results]  # the engine's order

    def _reject(self, rnd: int, client: int, node: int | None, why: str) -> None:
        log.warning("round %d: client %d (node %s) left out: %s", rnd, client, node, why)
        self.rejected.append({"round": rnd, "client": client, "node": node, "reason": why})

    def after_aggregate(self, exp, record, results):
        lost = {r["client"] for r in self.rejected if r["round"] == record["round"]}
        record["rejected"] = sorted(lost | set(record["rejected"]))

    def evaluations(self, state: dict, rnd: int) -> dict[int, SiteScore]:
        """Each node's score on its held-out split: a confusion matrix and a summed loss (the
        model is the global one, or a personalised client's own, which stays on its node)."""
        content = tree_to_records(state, "state", RecordDict())
        content["job"] = ConfigRecord({"round": rnd, "config": self.cfg_json})
        content[VERSIONS_RECORD] = ConfigRecord(self.versions)
        msgs = [Message(RecordDict(dict(content)), dst_node_id=n, message_type="evaluate",
                        group_id=f"eval{rnd}") for n in self.nodes.values()]
        client_of = {n: k for k, n in self.nodes.items()}
        C = self.exp.data.num_classes
        got: dict[int, SiteScore] = {}
        for reply in self._exchange(msgs, self.round_timeout):
            node = reply.metadata.src_node_id
            try:
                if reply.has_error():
                    raise ProtoflError(short(reply.error.reason))
                ev = tree_from_records(reply.content, "eval")
                m, loss = ev["confusion"], float(ev["loss_sum"])
                if (m.shape != (C, C) or m.is_floating_point() or bool((m < 0).any())
                        or not np.isfinite(loss)):
                    raise ProtoflError(f"a malformed score (confusion {tuple(m.shape)}, "
                                       f"loss {loss})")
            except (ProtoflError, KeyError, TypeError, ValueError) as e:
                log.warning("round %d evaluation: node %s left out: %s", rnd, node, e)
                continue
            got[client_of[node]] = SiteScore(m.numpy().astype(np.int64), loss)
        return got


FEDERATED = ("accuracy", "loss")  # site mode: logged as federated_accuracy, federated_loss
PER_SITE = ("local_accuracy", "client_accuracy", "clients_evaluated")  # only sites know them


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


def run_on_grid(cfg: Config, grid: Grid, out: Path | None = None, round_timeout: float = 600.0,
                node_wait: float = 120.0, resume: bool = False,
                callbacks: Sequence[Callback] = ()) -> Experiment:
    """Run ``cfg`` to the end on the SuperNodes of ``grid``; writes the run folder ``out``
    (config.json, metrics.jsonl, checkpoints, summary.json, plots) as the in-process engine
    does, plus ``flower.log``: the server's log lines (left-out replies, missing nodes). With
    ``resume`` a run folder holding a run continues from its checkpoint (:func:`restore`); an
    empty or missing one starts the run. ``callbacks`` are added to the run's."""
    from protofl.flower.secure import trainer_for  # privacy.secagg: SecAgg+ rounds

    trainer = trainer_for(cfg, grid, round_timeout, node_wait)
    metrics = [RemoteTestMetrics(trainer) if isinstance(cb, TestMetrics) else cb
               for cb in metric_callbacks()]
    store = RunStore(out) if out is not None else None
    # the store prepares the run folder before the trainer's on_run_start logs anything into it
    exp = Experiment(cfg, trainer=trainer, store=store, callbacks=[
        *metrics, *folder_callbacks(out, progress=False), trainer, *callbacks])
    if exp.cfg.data.pooled:
        raise ProtoflError(f"flower: {exp.alg.name} trains on the pooled data of every client, "
                           "which a federation never gathers; run it with `protofl run`")
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
            summary = exp.run()
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
                          callbacks)
    except ProtoflError as e:
        flwr_log(ERROR, "protofl: error: %s", e)
        raise
    flwr_log(INFO, "protofl: %s", summary_line(exp.summary(), folder))
    return exp


def transport(grid: Grid) -> str:
    """Whether the federation runs with TLS and SuperNode authentication (``flower/link.py``)."""
    simulated = type(grid).__name__ == "InMemoryGrid"
    return transport_line(simulated, None if simulated else superlink_args())


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
