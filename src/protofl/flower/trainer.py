"""The Flower trainer: a round's jobs sent to the SuperNodes holding the clients, the replies
turned back into ``ClientResult``s (``server_app.py`` runs the loop with it; ``secure.py``'s
SecAgg+ trainer extends it)."""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from protofl.data.site import SiteFederation
from protofl.engine.callbacks import Callback, RoundView
from protofl.engine.train import ClientResult, RoundContext
from protofl.errors import ProtoflError
from protofl.flower.link import superlink_args, transport_line
from protofl.flower.node import VERSIONS_RECORD, versions
from protofl.flower.records import tree_from_records, tree_to_records
from protofl.flower.setup import check_partitions
from protofl.metrics.sites import SiteScore

log = logging.getLogger("protofl.flower")

POLL_S = 0.2
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
    ``Grid``: when the run starts it finds which node holds which client (and, each round,
    which node a site that came back now has); each round's rejected clients are added to the
    metrics line.

    ``min_replies`` is the round policy: a round whose valid replies are fewer (than it, or
    than the round's jobs when they are fewer) is sent again once, to the nodes connected
    then; if it falls short again the run stops with one line (a ProtoflError), its folder
    keeping the checkpoint of the last complete round. 0: a round aggregates whatever came
    (nothing: the state stays as it was)."""

    name = "flower"

    def __init__(self, grid: Grid, round_timeout: float = 600.0, node_wait: float = 120.0,
                 min_replies: int = 1):
        self.grid, self.round_timeout, self.node_wait = grid, round_timeout, node_wait
        self.min_replies = min_replies
        self.nodes: dict[int, int] = {}
        self.asked: set[int] = set()  # the node ids asked which client they hold
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
        while True:
            self.join(max(deadline - time.monotonic(), 5.0))
            if len(self.nodes) == want or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        missing = sorted(set(range(want)) - set(self.nodes))
        if missing:
            log.warning("no SuperNode for clients %s; they are skipped when sampled", missing)
        log.info("%d of %d clients have a SuperNode", len(self.nodes), want)
        return self.nodes

    def join(self, timeout: float) -> None:
        """Ask the SuperNodes connected since the last call which client they hold: a site
        that came back under a new node id takes its client over from its old one."""
        want = self.exp.data.num_clients
        live = set(self.grid.get_node_ids())
        new = sorted(live - self.asked)
        self.asked.update(new)
        query = {"what": "partition", **({"config": self.cfg_json} if self.sites else {})}
        msgs = [Message(RecordDict({"query": ConfigRecord(query),
                                    VERSIONS_RECORD: ConfigRecord(self.versions)}),
                        dst_node_id=n, message_type="query") for n in new]
        for node, reply in self._exchange(msgs, timeout):
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
            old = self.nodes.get(pid)
            if old is not None and old in live:
                log.warning("nodes %s and %s both hold partition %s; using %s",
                            old, node, pid, old)
                continue
            if old is not None:
                log.warning("client %d is back, on node %s (node %s left)", pid, node, old)
            self.nodes[pid] = node
            if "num-examples" in info:
                self.sizes[pid] = int(info["num-examples"])
                log.info("site %d (node %s): %d training and %s held-out samples", pid,
                         node, self.sizes[pid], info.get("num-test"))

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

    def _exchange(self, msgs: list[Message], timeout: float) -> list[tuple[int, Message]]:
        """Push ``msgs``, pull replies until all came, their nodes left, or ``timeout``; each
        reply with the node its message went to (the SuperLink answers for a node it cannot
        reach, under its own id)."""
        if not msgs:
            return []
        dst = {}
        for mid, m in zip(self.grid.push_messages(msgs), msgs):
            dst[mid] = m.metadata.dst_node_id
        replies: list[tuple[int, Message]] = []
        deadline = time.monotonic() + timeout
        next_check = time.monotonic() + 2.0
        while dst and time.monotonic() < deadline:
            got = list(self.grid.pull_messages(list(dst)))
            for r in got:
                node = dst.pop(r.metadata.reply_to_message_id, None)
                if node is not None:
                    replies.append((node, r))
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
        """The round's results under the ``min_replies`` policy (see the class)."""
        rnd, need = rc.round, min(self.min_replies, len(rc.jobs))
        self.join(min(self.round_timeout, 30.0))  # sites that came back (or came late)
        results = self.send(rc)
        if len(results) >= need:
            return results
        log.warning("round %d: %d of %d clients replied, fewer than min-replies = %d; the "
                    "round is sent once more", rnd, len(results), len(rc.jobs), need)
        self.rejected = [r for r in self.rejected if r["round"] != rnd]
        self.join(min(self.round_timeout, 30.0))
        results = self.send(rc)
        if len(results) >= need:
            return results
        raise ProtoflError(
            f"flower: round {rnd}: {len(results)} of {len(rc.jobs)} clients replied, twice, "
            f"fewer than min-replies = {need}, so the run stopped; its folder keeps the "
            "checkpoint of its last complete round: bring the SuperNodes back and run it "
            "again with resume=true")

    def send(self, rc: RoundContext) -> list[ClientResult]:
        """One try of a round: each job to the node of its client, the replies back."""
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
        for node, reply in self._exchange(msgs, self.round_timeout):
            client = sent.pop(node)
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
        for node, reply in self._exchange(msgs, self.round_timeout):
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


def transport(grid: Grid) -> str:
    """Whether the federation runs with TLS and SuperNode authentication (``flower/link.py``)."""
    simulated = type(grid).__name__ == "InMemoryGrid"
    return transport_line(simulated, None if simulated else superlink_args())
