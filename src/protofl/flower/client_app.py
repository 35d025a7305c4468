"""The ClientApp: one SuperNode = one protofl client (its ``partition-id``).

A ``train`` message carries the broadcast (``broadcast``) and the job (``job``: round,
client, units of local work, the run's config as JSON). The client trains with
``protofl.engine.train.train_client`` (the engine's reference loop, so the algorithm's
client_begin / loss / client_end run exactly as in process) and replies with the upload and
its mean training loss. The client's persistent state (MOON's previous model, FedProIn's
previous prototypes) stays in ``context.state``; it never leaves the node.

In site mode (``data.name: site``) the node trains on its own files (node config
``data-root``, format ``data-name``): when the server asks it to describe itself it loads
them, checks them against the run's agreed classes and input shape (a mismatch is logged
here and sent back as an error reply, and the server leaves the node out) and reports its
sample counts. An ``evaluate`` message is answered, in either mode, with the node's
confusion matrix and summed loss on its held-out split (``metrics/sites.py``): no sample,
label or prediction leaves the node.

What a node decides for itself (``flower/node.py``): it imports nothing the server's config
names (``callbacks`` and trackers run on the server only), it trains on its own ``device``
(the CPU, logged, when it lacks the one asked for), ``threads`` and ``eval-batch``; it refuses
(one line) a server whose protofl minor or torch major version differs from its own; and it
writes one audit line per message it sends (``audit-dir``). Its data are built by its first
message and memory-mapped from its cache by the next (``data-cache=false``: rebuilt each
time). Under privacy (DP or SecAgg) it reports no sample counts: only whether it holds data.
"""

from __future__ import annotations

import hashlib
from logging import ERROR
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.logger import log

from protofl.engine import hetero
from protofl.engine.schedule import Job
from protofl.engine.train import ClientResult, RoundContext, train_client
from protofl.errors import ProtoflError
from protofl.flower.node import VERSIONS_RECORD, AuditLog, check_versions, node_config_json
from protofl.flower.records import tree_from_records, tree_to_records
from protofl.flower.setup import Node, check_partitions, node_build
from protofl.metrics.sites import score_split

STATE = "protofl.client_state"  # + a digest of the run's config: one state per protofl run
DATA_ROOT = "data-root"  # node-config key: this node's files (site mode), or its copy of them
DATA_NAME = "data-name"  # node-config key, site mode: their format (default data.site_format)
DATA_CACHE = "data-cache"  # node-config key: false rebuilds the node's data for every message


def partition_of(context: Context) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` from the node config (one clear error if absent)."""
    nc = context.node_config
    if "partition-id" not in nc or "num-partitions" not in nc:
        raise ProtoflError("flower: this SuperNode has no partition-id / num-partitions; start "
                           "it with --node-config 'partition-id=K num-partitions=N'")
    return int(nc["partition-id"]), int(nc["num-partitions"])


def node_experiment(cfg_json: str, context: Context) -> Node:
    """The run's Node on this node (its own files in site mode, the model its node config
    names in a heterogeneous run); a ProtoflError (a site whose files do not fit the
    federation) is logged on the node before it is raised."""
    pid, _ = partition_of(context)
    nc = context.node_config
    try:
        cfg_json = hetero.node_config(node_config_json(cfg_json, nc),
                                      str(nc.get(hetero.NODE_MODEL, "")))
        cache = str(nc.get(DATA_CACHE, "on")).lower() not in ("off", "false", "0")
        return node_build(cfg_json, str(nc.get(DATA_ROOT, "")), str(nc.get(DATA_NAME, "")),
                          pid, cache)
    except ProtoflError as e:
        log(ERROR, "protofl: this node cannot join the run: %s", e)
        raise


def own_model(context: Context) -> bool:
    """Whether this node names the model it trains (node config ``model``)."""
    return bool(context.node_config.get(hetero.NODE_MODEL, ""))


NOISE_SEED = "noise-seed"  # node config, privacy.reproducible_noise only: this node's seed


def upload_hook(b: Node, context: Context) -> Any:
    """What this node does to an upload before it leaves: its contribution when the clients
    compute them (client-side noise, secure aggregation), else nothing (None); its DP noise
    is drawn from the node's own ``noise-seed`` when it sets one."""
    secret = context.node_config.get(NOISE_SEED)
    return b.aggregation.client_hook(int(secret) if secret not in (None, "") else None)


def audit(context: Context) -> AuditLog:
    return AuditLog(context.node_config, context.run_id, partition_of(context)[0])


def checked(msg: Message, cfg_json: str | None = None) -> None:
    """Refuse (one line) a message from a server of another protofl/torch version."""
    try:
        check_versions(msg.content.config_records.get(VERSIONS_RECORD), cfg_json)
    except ProtoflError as e:
        log(ERROR, "protofl: this node refuses the run: %s", e)
        raise


app = ClientApp()


def describe_info(query: ConfigRecord | None, context: Context) -> dict:
    """What a node says of itself: its partition and, when the query carries the run's
    config, its training and held-out sample counts (site mode: after checking its files
    against the federation); under privacy (DP or SecAgg) only whether it holds data."""
    pid, n = partition_of(context)
    info = {"partition-id": pid, "num-partitions": n}
    if query is not None and "config" in query:
        node = node_experiment(str(query["config"]), context)
        data = node.fed.data
        check_partitions(n, data)
        train = int(data.train_sizes[pid])
        if node.aggregation.private:  # the counts are private: only whether there are any
            info["num-examples"] = int(train > 0)
        else:
            info.update({"num-examples": train,
                         "num-test": int(len(data.client_test(pid)[1]))})
    return info


@app.query()
def describe(msg: Message, context: Context) -> Message:
    """Reply to a ``query`` with :func:`describe_info` (after checking the versions)."""
    checked(msg)
    info = describe_info(msg.content.config_records.get("query"), context)
    audit(context).write("query", None, info)
    return Message(RecordDict({"node": ConfigRecord(info)}), reply_to=msg)


def state_key(cfg_json: str) -> str:
    return f"{STATE}.{hashlib.sha256(cfg_json.encode()).hexdigest()[:16]}"


def train_job(job, context: Context, broadcast) -> tuple[Node, ClientResult, str]:
    """This node's client trained for ``job`` (a round's job record) from ``broadcast`` on
    the node's own partition, with the run's upload hook (client-side DP noise, secure-sum
    contribution); returns the node, the result and the key of the client's state in the
    node's context (the caller keeps the state once it accepts the result)."""
    pid, n = partition_of(context)
    node = node_experiment(str(job["config"]), context)
    b = node.fed
    check_partitions(n, b.data)
    client = int(job["client"])
    if client != pid:
        raise ProtoflError(f"flower: job for client {client} sent to partition {pid}")
    key = state_key(str(job["config"]))
    state = tree_from_records(context.state, key) if key in context.state else {}
    work = Job(client, int(job["units"]), bool(job["straggler"]))
    alg, broadcast = hetero.node_view(b.alg, b.state, broadcast, client, own_model(context))
    t = int(job["round"])
    rc = RoundContext(alg, broadcast, [work], b.data, {client: state}, b.setup.at(t), t,
                      upload_hook(node, context))
    return node, train_client(rc, work), key


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of local training on this node's partition."""
    from protofl.flower import secure_client  # SecAgg+ stages

    if secure_client.is_secure(msg):
        return secure_client.secure_train(msg, context, train_job, audit)
    job = msg.content.config_records["job"]
    checked(msg, str(job["config"]))
    node, result, key = train_job(job, context, tree_from_records(msg.content, "broadcast"))
    if result.state:
        tree_to_records(result.state, key, context.state)
    content = tree_to_records(result.upload, "upload", RecordDict())
    metrics = {"loss": float(result.loss), "client": result.client}
    if not node.aggregation.private:  # under privacy the count stays here (or in the sum)
        metrics["num-examples"] = int(len(node.fed.data.client_train(result.client)[1]))
    content["metrics"] = MetricRecord(metrics)
    audit(context).write("train", int(job["round"]), {"upload": result.upload, **metrics},
                         noised=node.aggregation.client_noise)
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """This client's score on its held-out split: its confusion matrix and summed loss, with
    the model it is evaluated with (``eval_weights``: the global one, or a personalised
    client's own, before its first round the one it would start from)."""
    job = msg.content.config_records["job"]
    checked(msg, str(job["config"]))
    pid, _ = partition_of(context)
    b = node_experiment(str(job["config"]), context).fed
    server_state = tree_from_records(msg.content, "state")
    key = state_key(str(job["config"]))
    own = tree_from_records(context.state, key) if key in context.state else {}
    x, y = b.data.client_test(pid)
    alg, server_state = hetero.node_view(b.alg, b.state, server_state, pid, own_model(context))
    got = score_split(alg, alg.model, alg.eval_weights(server_state, own), server_state,
                      x, y, b.data.num_classes, b.spec.metrics.eval_batch, b.data.inputs)
    out = {"confusion": torch.from_numpy(got.confusion),
           "loss_sum": torch.tensor(got.loss_sum, dtype=torch.float64)}
    audit(context).write("evaluate", int(job["round"]), out)
    return Message(tree_to_records(out, "eval", RecordDict()), reply_to=msg)
