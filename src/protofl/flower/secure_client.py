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
from protofl.flower.node import check_versions
from protofl.flower.records import tree_from_arrays, tree_to_records
from protofl.nested import flatten


def is_secure(msg: Message) -> bool:
    """Whether a ``train`` message is a stage of the SecAgg+ protocol."""
    return RECORD_KEY_CONFIGS in msg.content.config_records


def secure_train(msg: Message, context: Context, train_job: Any, audit: Any) -> Message:
    """A SecAgg+ stage: the mod runs the protocol and calls :func:`fit` to train (with the
    ClientApp's ``train_job`` and ``audit``, passed in: this module imports no ClientApp)."""
    return secaggplus_mod(msg, context, lambda m, c: fit(m, c, train_job, audit))


def fit(msg: Message, context: Context, train_job: Any, audit: Any) -> Message:
    """Train this node's client on the broadcast and reply with its contribution as the
    legacy ``FitRes`` the mod masks (weight 1; the loss last, clamped to the range)."""
    ins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    job = ins.config
    check_versions(job, str(job["config"]))
    broadcast = tree_from_arrays(parameters_to_ndarrays(ins.parameters), str(job["skeleton"]))
    b, result, key = train_job(job, context, broadcast)
    if not b.fed.spec.privacy.secagg:
        raise ProtoflError("flower: a SecAgg+ round for a run without privacy.secagg")
    if not math.isfinite(result.loss):
        raise ProtoflError(f"client {result.client}: local training diverged "
                           f"(loss {result.loss})")
    if result.state:
        tree_to_records(result.state, key, context.state)
    reach = b.fed.spec.privacy.secagg_range  # the contribution's range was checked as made
    flat, names = flatten(result.upload), list(b.aggregation.reply_spec())
    arrays = [np.ascontiguousarray(flat[name].detach().to("cpu", torch.float64).numpy())
              for name in names]
    arrays.append(np.array([min(max(result.loss, -reach), reach)]))
    audit(context).write("train", int(job["round"]), dict(zip([*names, "loss"], arrays)),
                         secure=True, noised=b.aggregation.client_noise)
    res = FitRes(Status(Code.OK, "ok"), ndarrays_to_parameters(arrays), 1, {})
    return Message(compat.fitres_to_recorddict(res, keep_input=False), reply_to=msg)
