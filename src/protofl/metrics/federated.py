"""Per-round figures of the aggregate model: test accuracy and loss, local accuracy, training
loss, gradient dissimilarity and the aggregate mean margin (AMM).

Rows are taken as stored (uint8 pixels, say) and turned into model inputs a batch at a time
(``FederatedData.inputs``). Every sample size is "how many at most", and 0 switches its figure
off: the function then returns None (or nothing for the client figures).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from protofl import tasks
from protofl.algorithms import prototype_math
from protofl.algorithms.base import Algorithm, Tensors
from protofl.data.federated import FederatedData
from protofl.metrics import segmentation as seg
from protofl.metrics.classification import report
from protofl.models.nets import ProtoNet

Inputs = Callable[[torch.Tensor], torch.Tensor]

# proposed defaults of the metrics.* config keys
DISSIMILARITY_CLIENTS = 30  # probe clients of the gradient dissimilarity
DISSIMILARITY_ROWS = 100  # training rows per probe client (its first ones)
TRAIN_LOSS_SAMPLES = 2000  # seeded sample of the training rows for train_loss
EVAL_BATCH = 256  # rows per forward pass (larger batches are slower for CNNs on CPU)
PROBE_CHUNK_ROWS = 256  # padded rows differentiated together in the dissimilarity probe


@torch.no_grad()
def scores(alg: Algorithm, model: ProtoNet, params: Tensors, buffers: Tensors, state: Tensors,
           x: torch.Tensor, batch: int, inputs: Inputs | None = None) -> torch.Tensor:
    """Class scores of rows ``x``, ``batch`` rows a pass; ``inputs`` turns each batch of stored
    rows into model inputs (default: the rows are inputs already)."""
    model.eval()
    prep = inputs or (lambda v: v)
    return torch.cat([alg.predict(model, params, buffers, state, prep(x[i:i + batch]))
                      for i in range(0, max(len(x), 1), batch)])


def evaluate(alg: Algorithm, model: ProtoNet, params: Tensors, buffers: Tensors,
             state: Tensors, x: torch.Tensor, y: torch.Tensor, num_classes: int,
             batch: int = EVAL_BATCH, inputs: Inputs | None = None,
             class_names: list[str] | None = None) -> dict:
    """Classification report plus mean cross-entropy of the class scores (segmentation
    masks: ``metrics.segmentation.evaluate``, mIoU and pixel accuracy)."""
    if len(y) == 0:
        return {}
    if tasks.dense(y):
        model.eval()
        return seg.evaluate(lambda v: alg.predict(model, params, buffers, state, v), x, y,
                            num_classes, batch, inputs, class_names)
    s = scores(alg, model, params, buffers, state, x, batch, inputs)
    out = report(y.numpy(), s.argmax(1).numpy(), num_classes)
    out["loss"] = float(F.cross_entropy(s, y))
    return out


def client_predictions(alg: Algorithm, model: ProtoNet, state: Tensors, data: FederatedData,
                       client_states: dict[int, Tensors], batch: int = EVAL_BATCH,
                       clients: list[int] | None = None
                       ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``client -> (labels, predictions)`` on each client's own local test split (all clients,
    or ``clients``), with the weights ``alg.eval_weights`` gives it: the aggregate model's,
    or (personalised methods) the client's own, before its first round the one it would start
    from.

    Every client scored with the aggregate weights is scored in one pass over their
    concatenated test rows, split back by the offsets; only personalised models go one by one.
    """
    ks = range(data.num_clients) if clients is None else clients
    batch = tasks.rows_per_pass(data.y_local_test, batch)
    off = data.test_offsets
    ks = [int(k) for k in ks if off[k + 1] > off[k]]
    weights = {k: alg.eval_weights(state, client_states.get(k, {})) for k in ks}
    ks = [k for k in ks if weights[k] is not None]  # a personalised client without a model
    shared = [] if alg.personalized else ks
    preds: dict[int, torch.Tensor] = {}
    if shared:
        if shared == list(range(data.num_clients)):
            x = data.x_local_test
        else:
            x = data.x_local_test[torch.from_numpy(np.concatenate(
                [np.arange(off[k], off[k + 1]) for k in shared]))]
        w = weights[shared[0]]
        p = labels(alg, model, w["params"], w["buffers"], state, x, batch, data.inputs)
        sizes = [int(off[k + 1] - off[k]) for k in shared]
        preds.update(zip(shared, torch.split(p, sizes)))
    for k in ks if alg.personalized else []:
        w = weights[k]
        preds[k] = labels(alg, model, w["params"], w["buffers"], state, data.client_test(k)[0],
                          batch, data.inputs)
    return {k: (data.client_test(k)[1], preds[k]) for k in sorted(preds)}


def labels(alg: Algorithm, model: ProtoNet, params: Tensors, buffers: Tensors,
           state: Tensors, x: torch.Tensor, batch: int, inputs: Inputs | None = None
           ) -> torch.Tensor:
    """Predicted labels (argmax of the class scores) of rows ``x``, ``batch`` rows a pass
    (for label maps only a pass's scores are ever held)."""
    if len(x) == 0:
        return scores(alg, model, params, buffers, state, x, batch, inputs).argmax(1)
    return torch.cat([scores(alg, model, params, buffers, state, x[i:i + batch], batch,
                             inputs).argmax(1) for i in range(0, len(x), batch)])


def client_figures(preds: dict[int, tuple[torch.Tensor, torch.Tensor]], num_classes: int,
                   pooled: bool) -> dict:
    """``local_accuracy`` (mean over clients), ``client_accuracy`` (per client, by id) and
    ``clients_evaluated`` (how many clients those figures cover); with ``pooled``, also the
    classification report of all clients' predictions together (how personalised methods are
    scored). Segmentation: pixel accuracies and per-client mIoU too
    (``metrics.segmentation.client_figures``)."""
    if not preds:
        return {"clients_evaluated": 0}
    ks = sorted(preds)
    if tasks.dense(preds[ks[0]][0]):
        return {**seg.client_figures(preds, num_classes, pooled), "clients_evaluated": len(ks)}
    accs = [float((preds[k][1] == preds[k][0]).float().mean()) for k in ks]
    out = report(torch.cat([preds[k][0] for k in ks]).numpy(),
                 torch.cat([preds[k][1] for k in ks]).numpy(), num_classes) if pooled else {}
    out["local_accuracy"] = float(np.mean(accs))
    out["client_accuracy"] = dict(zip(map(str, ks), accs))
    out["clients_evaluated"] = len(ks)
    return out


def train_loss(alg: Algorithm, model: ProtoNet, state: Tensors, data: FederatedData,
               max_samples: int, seed: int, batch: int = EVAL_BATCH) -> float | None:
    """Cross-entropy of the aggregate model over (a seeded sample of up to ``max_samples``
    of) all training rows; None when ``max_samples`` is 0 or there are no rows."""
    n = len(data.y_train)
    if max_samples <= 0 or n == 0:
        return None
    idx = torch.arange(n) if n <= max_samples else torch.from_numpy(
        np.sort(np.random.default_rng(seed).choice(n, max_samples, replace=False)))
    weights = alg.global_weights(state)
    if tasks.dense(data.y_train):
        model.eval()
        return seg.mean_loss(lambda v: alg.predict(model, weights["params"], weights["buffers"],
                                                   state, v),
                             data.x_train[idx], data.y_train[idx], batch, data.inputs)
    s = scores(alg, model, weights["params"], weights["buffers"], state, data.x_train[idx], batch,
               data.inputs)
    return float(F.cross_entropy(s, data.y_train[idx]))


def client_gradients(model: ProtoNet, params: Tensors, buffers: Tensors,
                     xs: list[torch.Tensor], ys: list[torch.Tensor],
                     chunk_rows: int = PROBE_CHUNK_ROWS) -> torch.Tensor:
    """``(K, P)`` float64: row k is the gradient of client k's mean cross-entropy on
    ``(xs[k], ys[k])`` at ``(params, buffers)``, flattened in ``params`` order.

    Clients are taken largest first and grouped while the group, padded to its largest
    client's length with weight-0 rows, stays within ``chunk_rows``; each group is one
    ``vmap`` over clients of ``grad`` (the loss is a weighted mean, so padding adds nothing).
    """

    def loss(p, x, y, w):
        _, logits = functional_call(model, {**p, **buffers}, (x,))
        return (tasks.per_sample_cross_entropy(logits, y) * w).sum() / w.sum()

    per_client = vmap(grad(loss), in_dims=(None, 0, 0, 0))
    order = sorted(range(len(xs)), key=lambda k: -len(ys[k]))
    out: list[torch.Tensor | None] = [None] * len(xs)
    i = 0
    while i < len(order):
        width = len(ys[order[i]])
        group = order[i:i + max(1, chunk_rows // max(width, 1))]
        x = torch.stack([_pad(xs[k], width) for k in group])
        y = torch.stack([_pad(ys[k], width) for k in group])
        w = torch.stack([(torch.arange(width) < len(ys[k])).to(x.dtype) for k in group])
        g = per_client(params, x, y, w)
        flat = torch.cat([v.reshape(len(group), -1) for v in g.values()], 1).double()
        for j, k in enumerate(group):
            out[k] = flat[j]
        i += len(group)
    return torch.stack(out)  # type: ignore[arg-type]


def _pad(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` with its first row repeated to ``n`` rows."""
    if len(t) == n:
        return t
    return torch.cat([t, t[:1].expand(n - len(t), *t.shape[1:])])


def gradient_dissimilarity(model: ProtoNet, params: Tensors, buffers: Tensors,
                           data: FederatedData, clients: np.ndarray,
                           max_per_client: int = DISSIMILARITY_ROWS,
                           chunk_rows: int = PROBE_CHUNK_ROWS) -> float | None:
    """``(1/|K|) sum_k ||grad L_k(W) - grad L(W)||^2`` with ``grad L = sum n_k grad L_k / sum
    n_k`` over the given clients (cross-entropy at the aggregate weights; ``L_k`` on the first
    ``max_per_client`` training rows of client k, ``n_k`` its full size). None when there are
    no clients or ``max_per_client`` is 0."""
    ks = [int(k) for k in np.asarray(clients).tolist()
          if data.train_offsets[k + 1] > data.train_offsets[k]]
    if not ks or max_per_client <= 0:
        return None
    max_per_client = tasks.rows_per_pass(data.y_train, max_per_client)  # label maps: fewer
    chunk_rows = tasks.rows_per_pass(data.y_train, chunk_rows)
    model.eval()
    xs, ys = [], []
    for k in ks:
        x, y = data.client_train(k)
        xs.append(data.inputs(x[:max_per_client]))
        ys.append(y[:max_per_client])
    gs = client_gradients(model, params, buffers, xs, ys, chunk_rows)
    w = torch.tensor([float(data.train_sizes[k]) for k in ks], dtype=torch.float64)
    mean = (w.unsqueeze(1) * gs).sum(0) / w.sum()
    return float(((gs - mean) ** 2).sum(1).mean())


def expensive_due(round_: int, every: int, last: int) -> bool:
    """Whether the costly figures (training loss, gradient dissimilarity) are computed at
    round ``round_``: every ``every``-th round and the last one; ``every`` 0: never."""
    return every > 0 and (round_ % every == 0 or round_ == last)


def aggregate_mean_margin(protos: torch.Tensor, counts: torch.Tensor, server: torch.Tensor,
                          reported: torch.Tensor | None = None) -> float:
    """AMM: mean over clients and their present classes of SPM(P_k, P) against the aggregate
    prototypes ``server`` of the classes in ``reported`` (default: all; a class no client has
    reported is a zero vector, not a prototype). ``protos (K, C, d)``, ``counts (K, C)``."""
    if reported is None:
        reported = torch.ones(server.shape[0], dtype=torch.bool)
    vals = []
    for p, n in zip(protos, counts):
        s = prototype_math.spm(p.double(), server.double(), n > 0, reported)
        vals.append(s[~torch.isnan(s)])
    v = torch.cat(vals) if vals else torch.empty(0)
    return float(v.mean()) if len(v) else float("nan")
