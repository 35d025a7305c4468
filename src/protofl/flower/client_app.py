"""The ClientApp: one SuperNode = one protofl client (its ``partition-id``).

A ``train`` message carries the broadcast (``broadcast``) and the job (``job``: round,
client, units of local work, the run's config as JSON). The client trains with
``protofl.engine.train.train_client`` (the engine's reference loop, so the algorithm's
client_begin / loss / client_end run exactly as in process) and replies with the upload and
its mean training loss. The client's persistent state (MOON's previous model, FedProIn's
previous prototypes) stays in ``context.state``; it never leaves the node.
"""

from __future__ import annotations

import hashlib

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from protofl.engine.schedule import Job
from protofl.engine.train import RoundContext, train_client
from protofl.errors import ProtoflError
from protofl.flower.records import tree_from_records, tree_to_records
from protofl.flower.setup import build, check_partitions
from protofl.metrics.federated import client_predictions

STATE = "protofl.client_state"  # + a digest of the run's config: one state per protofl run
DATA_ROOT = "data-root"  # optional node-config key: this node's copy of the dataset files


def partition_of(context: Context) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` from the node config (one clear error if absent)."""
    nc = context.node_config
    if "partition-id" not in nc or "num-partitions" not in nc:
        raise ProtoflError("flower: this SuperNode has no partition-id / num-partitions; start "
                           "it with --node-config 'partition-id=K num-partitions=N'")
    return int(nc["partition-id"]), int(nc["num-partitions"])


app = ClientApp()


@app.query()
def describe(msg: Message, context: Context) -> Message:
    """Reply to a ``query``: which partition this node holds."""
    pid, n = partition_of(context)
    return Message(RecordDict({"node": ConfigRecord({"partition-id": pid,
                                                     "num-partitions": n})}), reply_to=msg)


def state_key(cfg_json: str) -> str:
    return f"{STATE}.{hashlib.sha256(cfg_json.encode()).hexdigest()[:16]}"


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of local training on this node's partition."""
    from protofl.flower import secure  # privacy.*: SecAgg+ stages, client-side DP noise

    if secure.is_secure(msg):
        return secure.secure_train(msg, context)
    job = msg.content.config_records["job"]
    pid, n = partition_of(context)
    b = build(str(job["config"]), str(context.node_config.get(DATA_ROOT, "")))
    check_partitions(n, b.data)
    client = int(job["client"])
    if client != pid:
        raise ProtoflError(f"flower: job for client {client} sent to partition {pid}")
    broadcast = tree_from_records(msg.content, "broadcast")
    key = state_key(str(job["config"]))
    state = tree_from_records(context.state, key) if key in context.state else {}
    work = Job(client, int(job["units"]), bool(job["straggler"]))
    rc = RoundContext(b.alg, broadcast, [work], b.data, {client: state}, b.setup,
                      int(job["round"]), secure.upload_hook(b, context))
    result = train_client(rc, work)
    if result.state:
        tree_to_records(result.state, key, context.state)
    content = tree_to_records(result.upload, "upload", RecordDict())
    content["metrics"] = MetricRecord({"loss": float(result.loss), "client": client,
                                       "num-examples": int(len(b.data.client_train(pid)[1]))})
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Personalised methods: predictions of this client's own model (the global weights if it
    has none) on its local test split; only labels and predictions leave the node."""
    job = msg.content.config_records["job"]
    pid, _ = partition_of(context)
    b = build(str(job["config"]), str(context.node_config.get(DATA_ROOT, "")))
    server_state = tree_from_records(msg.content, "state")
    key = state_key(str(job["config"]))
    own = tree_from_records(context.state, key) if key in context.state else {}
    got = client_predictions(b.alg, b.alg.model, server_state, b.data, {pid: own},
                             b.cfg.metrics.eval_batch, clients=[pid])
    y = b.data.client_test(pid)[1]
    # no model yet (or no test samples): predictions of -1, left out by the server
    out = {"y": y, "pred": got[pid][1] if pid in got else torch.full_like(y, -1)}
    return Message(tree_to_records(out, "eval", RecordDict()), reply_to=msg)
