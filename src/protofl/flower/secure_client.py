"""The ClientApp's half of secure aggregation and client-side DP noise on Flower (the
server's half, and the whole protocol, are described in :mod:`protofl.flower.secure`). Kept
apart so that a node's ClientApp imports no server-side code."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from flwr.app import Context, Message
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat

from protofl.errors import ProtoflError
from protofl.flower.client_app import train_job
from protofl.flower.records import tree_from_arrays, tree_to_records
from protofl.flower.setup import Node
from protofl.nested import flatten

NOISE_SEED = "noise-seed"  # node-config key: this node's secret seed for its DP noise


def upload_hook(b: Node, context: Context) -> Any:
    """What this node does to an upload before it leaves: its contribution when the clients
    compute them (client-side noise, secure aggregation), else nothing (None); its DP noise
    is drawn from the node's own ``noise-seed`` when it sets one."""
    secret = context.node_config.get(NOISE_SEED)
    return b.aggregation.client_hook(int(secret) if secret not in (None, "") else None)


def is_secure(msg: Message) -> bool:
    """Whether a ``train`` message is a stage of the SecAgg+ protocol."""
    return RECORD_KEY_CONFIGS in msg.content.config_records


def secure_train(msg: Message, context: Context) -> Message:
    """A SecAgg+ stage: the mod runs the protocol and calls :func:`fit` to train."""
    return secaggplus_mod(msg, context, fit)


def fit(msg: Message, context: Context) -> Message:
    """Train this node's client on the broadcast and reply with its contribution as the
    legacy ``FitRes`` the mod masks (weight 1; the loss last, clamped to the range)."""
    ins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    job = ins.config
    broadcast = tree_from_arrays(parameters_to_ndarrays(ins.parameters), str(job["skeleton"]))
    b, result, key = train_job(job, context, broadcast)
    if not b.fed.spec.privacy.secagg:
        raise ProtoflError("flower: a SecAgg+ round for a run without privacy.secagg")
    if not math.isfinite(result.loss):
        raise ProtoflError(f"client {result.client}: local training diverged "
                           f"(loss {result.loss})")
    if result.state:
        tree_to_records(result.state, key, context.state)
    reach = b.fed.spec.privacy.secagg_range
    flat = flatten(result.upload)
    arrays = []
    for name in b.aggregation.reply_spec():
        a = flat[name].detach().to("cpu", torch.float64).numpy()
        if not np.isfinite(a).all() or (a.size and np.abs(a).max() > reach):
            top = float(np.abs(a).max()) if np.isfinite(a).all() else math.nan
            raise ProtoflError(f"client {result.client}: contribution {name!r} reaches {top:.4g}, "
                               f"outside privacy.secagg_range = {reach:g}; raise it")
        arrays.append(np.ascontiguousarray(a))
    arrays.append(np.array([min(max(result.loss, -reach), reach)]))
    res = FitRes(Status(Code.OK, "ok"), ndarrays_to_parameters(arrays), 1, {})
    return Message(compat.fitres_to_recorddict(res, keep_input=False), reply_to=msg)
