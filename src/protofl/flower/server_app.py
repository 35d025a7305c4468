"""The ServerApp: protofl's round loop with Flower SuperNodes as the trainers.

The server is ``protofl.engine.experiment.Experiment`` (same sampling, stragglers,
aggregation, evaluation, AMM, run folder) given a :class:`FlowerTrainer`, which instead of
training in process sends each job to the SuperNode holding that client's partition and turns
the replies back into ``ClientResult``s. An error reply (node died), a missing reply or an
unreadable record is logged with the node and the problem and left out; the engine then
checks every upload as it checks in-process ones (``Experiment.screen``: missing keys, wrong
shapes, NaN/Inf, negative counts). The round goes on with the rest, and a round with no valid
reply keeps the previous global state.

Client-side state never reaches the server: for personalised methods each node predicts its
own local test split with its own model and the server pools labels and predictions (the
engine's figures, except training loss and gradient dissimilarity, which need the weights).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from protofl.api import folder_callbacks
from protofl.config import Config
from protofl.engine import runfolder
from protofl.engine.callbacks import Callback, TestMetrics, metric_callbacks
from protofl.engine.experiment import Experiment
from protofl.engine.train import ClientResult, RoundContext
from protofl.errors import ProtoflError
from protofl.flower.records import tree_from_records, tree_to_records
from protofl.flower.setup import OUT, check_partitions, config_from_run
from protofl.metrics.federated import client_figures

log = logging.getLogger("protofl.flower")

ROUND_TIMEOUT = "round-timeout"  # seconds to wait for a round's replies
NODE_WAIT = "node-wait"  # seconds to wait for every client's SuperNode to connect
POLL_S = 0.2
LOG_FILE = "flower.log"


def short(reason: str) -> str:
    """The last non-empty line of an error reply's reason (Ray wraps it in a traceback)."""
    lines = [x.strip() for x in str(reason).splitlines() if x.strip()]
    return (lines[-1] if lines else "unknown error")[:300]


class FlowerTrainer(Callback):
    """A trainer (and round callback) whose clients are SuperNodes reached through a Flower
    ``Grid``: when the run starts it finds which node holds which client; each round's
    rejected clients are added to the metrics line."""

    name = "flower"

    def __init__(self, grid: Grid, round_timeout: float = 600.0, node_wait: float = 120.0):
        self.grid, self.round_timeout, self.node_wait = grid, round_timeout, node_wait
        self.nodes: dict[int, int] = {}
        self.rejected: list[dict[str, Any]] = []
        self.cfg_json = ""

    def on_run_start(self, exp: Experiment) -> None:
        self.exp = exp
        self.cfg_json = json.dumps(exp.cfg.to_dict(), sort_keys=True)
        self.nodes = self.discover(self.node_wait)

    # ---- which node holds which client ----
    def discover(self, wait: float) -> dict[int, int]:
        """Map client (partition-id) -> node id, asking every connected SuperNode; waits up
        to ``wait`` s for one node per client, then goes on with those it has."""
        want = self.exp.data.num_clients
        deadline = time.monotonic() + wait
        nodes: dict[int, int] = {}
        asked: set[int] = set()
        while True:
            new = [n for n in self.grid.get_node_ids() if n not in asked]
            asked.update(new)
            msgs = [Message(RecordDict({"query": ConfigRecord({"what": "partition"})}),
                            dst_node_id=n, message_type="query") for n in new]
            for reply in self._exchange(msgs, max(deadline - time.monotonic(), 5.0)):
                node = reply.metadata.src_node_id
                if reply.has_error():
                    log.warning("node %s did not describe itself: %s", node,
                                short(reply.error.reason))
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
            if len(nodes) == want or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        missing = sorted(set(range(want)) - set(nodes))
        if missing:
            log.warning("no SuperNode for clients %s; they are skipped when sampled", missing)
        log.info("%d of %d clients have a SuperNode", len(nodes), want)
        return nodes

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
                "straggler": job.straggler, "config": self.cfg_json})})
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

    def predictions(self, state: dict, rnd: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Each node's labels and predictions on its local test split (personalised methods:
        the clients' own models stay on the nodes)."""
        content = tree_to_records(state, "state", RecordDict())
        content["job"] = ConfigRecord({"round": rnd, "config": self.cfg_json})
        msgs = [Message(RecordDict(dict(content)), dst_node_id=n, message_type="evaluate",
                        group_id=f"eval{rnd}") for n in self.nodes.values()]
        client_of = {n: k for k, n in self.nodes.items()}
        got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for reply in self._exchange(msgs, self.round_timeout):
            node = reply.metadata.src_node_id
            try:
                if reply.has_error():
                    raise ProtoflError(short(reply.error.reason))
                ev = tree_from_records(reply.content, "eval")
                y, pred = ev["y"].long(), ev["pred"].long()
                if y.shape != pred.shape or y.dim() != 1:
                    raise ProtoflError("labels and predictions differ in shape")
            except (ProtoflError, KeyError) as e:
                log.warning("evaluation: node %s left out: %s", node, e)
                continue
            if len(y) and bool((pred >= 0).all()):
                got[client_of[node]] = (y, pred)
        return got


class RemoteTestMetrics(TestMetrics):
    """The engine's test metrics; for personalised methods each node scores its own model on
    its local test split and the server pools the labels and predictions."""

    def __init__(self, trainer: FlowerTrainer):
        self.trainer = trainer

    def on_evaluate(self, exp, record):
        if not exp.alg.personalized:
            return super().on_evaluate(exp, record)
        got = self.trainer.predictions(exp.state, exp.round)
        if got:
            record.update(client_figures(got, exp.data.num_classes, pooled=True))


def run_on_grid(cfg: Config, grid: Grid, out: Path | None = None, round_timeout: float = 600.0,
                node_wait: float = 120.0) -> Experiment:
    """Run ``cfg`` to the end on the SuperNodes of ``grid``; writes the run folder ``out``
    (config.json, metrics.jsonl, checkpoints, summary.json, plots) as the in-process engine
    does, plus ``flower.log``: the server's log lines (left-out replies, missing nodes)."""
    from protofl.flower.secure import trainer_for  # privacy.secagg: SecAgg+ rounds

    trainer = trainer_for(cfg, grid, round_timeout, node_wait)
    metrics = [RemoteTestMetrics(trainer) if isinstance(cb, TestMetrics) else cb
               for cb in metric_callbacks()]
    # the run folder is prepared before the trainer's on_run_start logs anything into it
    exp = Experiment(cfg, trainer=trainer, callbacks=[
        *metrics, *folder_callbacks(out, overwrite=False, progress=False), trainer])
    if exp.alg.centralized:
        raise ProtoflError(f"flower: {exp.alg.name} trains on the pooled data of every client, "
                           "which a federation never gathers; run it with `protofl run`")
    if out is None:
        exp.run()
        return exp
    engine_log = logging.getLogger("protofl")  # the engine's and this module's lines
    handler = logging.FileHandler(out / LOG_FILE, delay=True)  # opened at the first line
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    engine_log.addHandler(handler)
    engine_log.setLevel(logging.INFO)
    try:
        with runfolder.lock(out):
            summary = exp.run()
        log.info("protofl run finished: %s", {k: summary.get(k) for k in (
            "algorithm", "dataset", "rounds", "accuracy")})
    finally:
        engine_log.removeHandler(handler)
        handler.close()
    return exp


def make_server_app(cfg: Config | None = None, out: Path | None = None,
                    on_finish: Any = None) -> ServerApp:
    """A ServerApp for ``cfg`` (``None``: read the run config); ``on_finish(exp)`` is called
    with the finished FlowerExperiment (tests, notebooks)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        rc = context.run_config
        run_cfg = cfg if cfg is not None else config_from_run(rc)
        folder = out if out is not None or not rc.get(OUT) else Path(str(rc[OUT]))
        exp = run_on_grid(run_cfg, grid, folder, float(rc.get(ROUND_TIMEOUT, 600.0)),
                          float(rc.get(NODE_WAIT, 120.0)))
        if on_finish is not None:
            on_finish(exp)

    return app


app = make_server_app()
