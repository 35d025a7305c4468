"""Per-round figures of the aggregate model: test accuracy and loss, local accuracy, training
loss, gradient dissimilarity and the aggregate mean margin (AMM).

Rows are taken as stored (uint8 pixels, say), moved to the model's device and turned into
model inputs a batch at a time (``FederatedData.inputs``). Every sample size is "how many at
most", and 0 switches its figure off: the function then returns None (or nothing for the client
figures).

The gradient dissimilarity is, by default, an *estimate*: over a seeded sample of probe clients
(``metrics.dissimilarity_clients``) and each one's first rows (``metrics.dissimilarity_rows``),
not the mean over every client and all its rows that the seed plots; ``exact`` (every client,
every row) is available and streams, so its memory does not grow with the number of clients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from protofl import device as devices
from protofl import tasks
from protofl.algorithms import prototype_math
from protofl.algorithms.base import Algorithm, Tensors
from protofl.algorithms.capabilities import personalized
from protofl.data.federated import FederatedData
from protofl.metrics import segmentation as seg
from protofl.metrics.classification import auc, report, spread
from protofl.models.nets import ProtoNet

Inputs = Callable[[torch.Tensor], torch.Tensor]

# proposed defaults of the metrics.* config keys
DISSIMILARITY_CLIENTS = 30  # probe clients of the gradient dissimilarity
DISSIMILARITY_ROWS = 100  # training rows per probe client (its first ones)
TRAIN_LOSS_SAMPLES = 2000  # seeded sample of the training rows for train_loss
EVAL_BATCH = 256  # rows per forward pass (larger batches are slower for CNNs on CPU)
PROBE_CHUNK_ROWS = 256  # padded rows differentiated together in the dissimilarity probe
PROBE_GROUP_BYTES = 256 << 20  # at most this many bytes of per-client gradients at once


def predictor(alg: Algorithm, model: ProtoNet, params: Tensors, buffers: Tensors,
              state: Tensors, inputs: Inputs | None = None
              ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``alg.predict`` with these weights as a function of host rows, computed on the
    model's device (eval mode; scores at least float32, on that device); ``inputs`` turns
    the uploaded rows into model inputs there (stored uint8 rows travel as they are). Rows
    that the device's free memory would not hold in one pass go in several
    (``device.forward_rows``)."""
    model.eval()
    dev = devices.model_device(model)
    params, buffers, state = (devices.to_device(v, dev) for v in (params, buffers, state))
    prep = inputs or (lambda v: v)

    def one(x: torch.Tensor) -> torch.Tensor:
        out = alg.predict(model, params, buffers, state, prep(devices.upload(x, dev)))
        return out if out.dtype in (torch.float32, torch.float64) else out.float()

    def predict(x: torch.Tensor) -> torch.Tensor:
        step = devices.forward_rows(dev, x, len(x), one, model)
        if step >= len(x):
            return one(x)
        return torch.cat([one(x[i:i + step]) for i in range(0, len(x), step)])
    return predict


@torch.no_grad()
def scores(alg: Algorithm, model: ProtoNet, params: Tensors, buffers: Tensors, state: Tensors,
           x: torch.Tensor, batch: int, inputs: Inputs | None = None) -> torch.Tensor:
    """Class scores of rows ``x``, ``batch`` rows a pass, computed on the model's device (at
    least float32); ``inputs`` turns each batch of stored rows into model inputs (default: the
    rows are inputs already)."""
    predict = predictor(alg, model, params, buffers, state, inputs)
    return torch.cat([predict(x[i:i + batch]) for i in range(0, max(len(x), 1), batch)])


def evaluate(alg: Algorithm, model: ProtoNet, params: Tensors, buffers: Tensors,
             state: Tensors, x: torch.Tensor, y: torch.Tensor, num_classes: int,
             batch: int = EVAL_BATCH, inputs: Inputs | None = None,
             class_names: list[str] | None = None) -> dict:
    """Classification report plus mean cross-entropy and ROC AUC of the class scores
    (segmentation masks: ``metrics.segmentation.evaluate``, mIoU and pixel accuracy)."""
    if len(y) == 0:
        return {}
    if tasks.dense(y):
        return seg.evaluate(predictor(alg, model, params, buffers, state, inputs), x, y,
                            num_classes, batch, class_names=class_names)
    s = scores(alg, model, params, buffers, state, x, batch, inputs)
    out = report(y.numpy(), s.argmax(1).cpu().numpy(), num_classes)
    out["loss"] = float(F.cross_entropy(s, y.to(s.device)))
    out["auc"] = auc(y.numpy(), s.float().cpu().numpy())
    return out


def client_predictions(alg: Algorithm, model: ProtoNet, state: Tensors, data: FederatedData,
                       client_states: dict[int, Tensors], batch: int = EVAL_BATCH,
                       clients: list[int] | None = None
                       ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``client -> (labels, outputs)`` on each client's own local test split (all clients,
    or ``clients``), with the weights ``alg.eval_weights`` gives it: the aggregate model's,
    or (personalised methods) the client's own, before its first round the one it would start
    from. Outputs are class scores ``(n, C)`` (classification) or predicted label maps
    (segmentation).

    Every client scored with the aggregate weights is scored in one pass over their
    concatenated test rows, split back by the offsets; only personalised models go one by one.
    """
    ks = range(data.num_clients) if clients is None else clients
    batch = tasks.rows_per_pass(data.y_local_test, batch)
    off = data.test_offsets
    ks = [int(k) for k in ks if off[k + 1] > off[k]]
    weights = {k: alg.eval_weights(state, client_states.get(k, {})) for k in ks}
    ks = [k for k in ks if weights[k] is not None]  # a personalised client without a model
    shared = [] if personalized(alg) else ks
    preds: dict[int, torch.Tensor] = {}
    if shared:
        if shared == list(range(data.num_clients)):
            x = data.x_local_test
        else:
            x = data.x_local_test[torch.from_numpy(np.concatenate(
                [np.arange(off[k], off[k + 1]) for k in shared]))]
        w = weights[shared[0]]
        p = outputs(alg, model, w["params"], w["buffers"], state, x, batch, data.inputs)
        sizes = [int(off[k + 1] - off[k]) for k in shared]
        preds.update(zip(shared, torch.split(p, sizes)))
    for k in ks if personalized(alg) else []:
        w = weights[k]
        preds[k] = outputs(alg, model, w["params"], w["buffers"], state,
                           data.client_test(k)[0], batch, data.inputs)
    return {k: (data.client_test(k)[1], preds[k]) for k in sorted(preds)}


@torch.no_grad()
def outputs(alg: Algorithm, model: ProtoNet, params: Tensors, buffers: Tensors,
            state: Tensors, x: torch.Tensor, batch: int, inputs: Inputs | None = None
            ) -> torch.Tensor:
    """Class scores (classification, at least float32) or predicted label maps (segmentation: only a
    pass's scores are ever held) of rows ``x``, on the CPU, ``batch`` rows a pass."""
    predict = predictor(alg, model, params, buffers, state, inputs)  # weights moved once
    passes = (predict(x[i:i + batch]) for i in range(0, max(len(x), 1), batch))
    return torch.cat([s.argmax(1).cpu() if s.dim() > 2 else s.cpu() for s in passes])


def client_figures(preds: dict[int, tuple[torch.Tensor, torch.Tensor]], num_classes: int,
                   pooled: bool) -> dict:
    """``local_accuracy`` (mean over clients), ``client_accuracy`` (per client, by id), its
    spread (``classification.spread``) and ``clients_evaluated`` (how many clients those
    figures cover), from ``client -> (labels, outputs)`` (``client_predictions``); with
    ``pooled``, also the classification report and the ROC AUC of all clients' predictions
    together (how personalised methods are scored). Segmentation: pixel accuracies and
    per-client mIoU too (``metrics.segmentation.client_figures``)."""
    if not preds:
        return {"clients_evaluated": 0}
    ks = sorted(preds)
    if tasks.dense(preds[ks[0]][0]):
        return {**seg.client_figures(preds, num_classes, pooled), "clients_evaluated": len(ks)}
    labels = {k: preds[k][1].argmax(1) for k in ks}
    accs = [float((labels[k] == preds[k][0]).float().mean()) for k in ks]
    out = {}
    if pooled:
        y = torch.cat([preds[k][0] for k in ks]).numpy()
        out = report(y, torch.cat([labels[k] for k in ks]).numpy(), num_classes)
        out["auc"] = auc(y, torch.cat([preds[k][1] for k in ks]).numpy())
    out["local_accuracy"] = float(np.mean(accs))
    out["client_accuracy"] = dict(zip(map(str, ks), accs))
    out.update(spread(accs))
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
        return seg.mean_loss(predictor(alg, model, weights["params"], weights["buffers"], state,
                                       data.inputs), data.x_train[idx], data.y_train[idx], batch)
    s = scores(alg, model, weights["params"], weights["buffers"], state, data.x_train[idx], batch,
               data.inputs)
    return float(F.cross_entropy(s, data.y_train[idx].to(s.device)))


Rows = Callable[[int, int, int], tuple[torch.Tensor, torch.Tensor]]  # (client, a, b) -> x, y


def client_gradient_stream(model: ProtoNet, params: Tensors, buffers: Tensors, sizes: list[int],
                           rows: Rows, chunk_rows: int = PROBE_CHUNK_ROWS
                           ) -> Iterator[tuple[int, torch.Tensor]]:
    """``(i, g_i)`` for every client ``i`` (in order of ``sizes``, its rows to use): ``g_i``
    the gradient of its mean cross-entropy on ``rows(i, 0, sizes[i])``, at ``(params,
    buffers)``, flattened in ``params`` order, float64, on the weights' device (on the CPU
    from a device without float64).

    Each client's rows are cut into pieces of at most ``chunk_rows``; consecutive pieces are
    differentiated together, one ``vmap`` of ``grad`` of the summed loss over a group padded
    to its longest piece with weight-0 rows, within ``chunk_rows`` padded rows and
    ``PROBE_GROUP_BYTES`` of gradients. A client's pieces are summed and divided by its row
    count, and the client is yielded as soon as its last piece is done, so at most a group's
    gradients and one partial sum are held, whatever the number of clients."""

    def summed(p, x, y, w):
        _, logits = functional_call(model, {**p, **buffers}, (x,))
        return (tasks.per_sample_cross_entropy(logits, y) * w).sum()

    per_piece = vmap(grad(summed), in_dims=(None, 0, 0, 0))
    pbytes = 4 * sum(v.numel() for v in params.values())
    most = max(1, PROBE_GROUP_BYTES // max(pbytes, 1))
    pieces = [(i, a, min(a + chunk_rows, n)) for i, n in enumerate(sizes)
              for a in range(0, n, max(chunk_rows, 1))]
    partial: torch.Tensor | None = None
    start = 0
    while start < len(pieces):
        width, end = pieces[start][2] - pieces[start][1], start + 1
        while end < len(pieces) and end - start < most:
            w = max(width, pieces[end][2] - pieces[end][1])
            if (end - start + 1) * w > chunk_rows:
                break
            width, end = w, end + 1
        group = pieces[start:end]
        got = [rows(i, a, b) for i, a, b in group]
        x = torch.stack([_pad(v, width) for v, _ in got])
        y = torch.stack([_pad(v, width) for _, v in got])
        w = (torch.arange(width, device=x.device) < torch.tensor(
            [b - a for _, a, b in group], device=x.device)[:, None]).to(x.dtype)
        g = per_piece(params, x, y, w)
        flat = devices.float64(torch.cat([v.reshape(len(group), -1) for v in g.values()], 1))
        for j, (i, _, b) in enumerate(group):
            partial = flat[j] if partial is None else partial + flat[j]
            if b == sizes[i]:  # the client's last piece
                yield i, partial / sizes[i]
                partial = None
        start = end


def client_gradients(model: ProtoNet, params: Tensors, buffers: Tensors,
                     xs: list[torch.Tensor], ys: list[torch.Tensor],
                     chunk_rows: int = PROBE_CHUNK_ROWS) -> torch.Tensor:
    """``(K, P)`` float64: row k is the gradient of client k's mean cross-entropy on
    ``(xs[k], ys[k])`` (model inputs) at ``(params, buffers)``, flattened in ``params`` order
    (``client_gradient_stream`` over lists)."""
    dev = devices.model_device(model)
    out = dict(client_gradient_stream(
        model, params, buffers, [len(y) for y in ys],
        lambda i, a, b: (xs[i][a:b].to(dev), ys[i][a:b].to(dev)), chunk_rows))
    return torch.stack([out[k] for k in range(len(xs))])


def _pad(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` with its first row repeated to ``n`` rows."""
    if len(t) == n:
        return t
    return torch.cat([t, t[:1].expand(n - len(t), *t.shape[1:])])


def gradient_dissimilarity(model: ProtoNet, params: Tensors, buffers: Tensors,
                           data: FederatedData, clients: np.ndarray,
                           max_per_client: int | None = DISSIMILARITY_ROWS,
                           chunk_rows: int = PROBE_CHUNK_ROWS) -> float | None:
    """``(1/|K|) sum_k ||grad L_k(W) - grad L(W)||^2`` with ``grad L = sum n_k grad L_k / sum
    n_k`` over the given clients (cross-entropy at the aggregate weights; ``L_k`` on the first
    ``max_per_client`` training rows of client k, all of them when None; ``n_k`` its full
    size), computed on the weights' device. None when there are no clients or
    ``max_per_client`` is 0.

    Streamed: ``sum_k ||g_k||^2``, ``sum_k g_k`` and ``sum_k n_k g_k`` are accumulated in
    float64 and the figure is ``S1/K - 2 m.g + ||g||^2`` (``m`` the plain mean, ``g`` the
    weighted one), the same quantity without holding every client's gradient."""
    ks = [int(k) for k in np.asarray(clients).tolist()
          if data.train_offsets[k + 1] > data.train_offsets[k]]
    if not ks or (max_per_client is not None and max_per_client <= 0):
        return None
    chunk_rows = tasks.rows_per_pass(data.y_train, chunk_rows)  # label maps: fewer at once
    model.eval()
    dev = devices.model_device(model)
    params, buffers = devices.to_device(params, dev), devices.to_device(buffers, dev)
    full = [int(data.train_sizes[k]) for k in ks]
    used = full if max_per_client is None else [min(n, max_per_client) for n in full]

    def rows(i: int, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        off = int(data.train_offsets[ks[i]])
        return (data.inputs(devices.upload(data.x_train[off + a:off + b], dev)),
                data.y_train[off + a:off + b].to(dev))

    squares, plain, weighted = 0.0, None, None
    for i, g in client_gradient_stream(model, params, buffers, used, rows, chunk_rows):
        squares += float(g @ g)
        plain = g.clone() if plain is None else plain.add_(g)
        weighted = g * full[i] if weighted is None else weighted.add_(g, alpha=full[i])
    mean_plain, mean = plain / len(ks), weighted / sum(full)
    return squares / len(ks) - 2 * float(mean_plain @ mean) + float(mean @ mean)


def expensive_due(round_: int, every: int, last: int) -> bool:
    """Whether the costly figures (training loss, gradient dissimilarity, local accuracy) are
    computed at round ``round_``: every ``every``-th round and the last one; ``every`` 0:
    never."""
    return every > 0 and (round_ % every == 0 or round_ == last)


def aggregate_mean_margin(protos: torch.Tensor, counts: torch.Tensor, server: torch.Tensor,
                          reported: torch.Tensor | None = None) -> float:
    """AMM: mean over clients and their present classes of SPM(P_k, P) against the aggregate
    prototypes ``server`` of the classes in ``reported`` (default: all; a class no client has
    reported is a zero vector, not a prototype). ``protos (K, C, d)``, ``counts (K, C)``."""
    if reported is None:
        reported = torch.ones(server.shape[0], dtype=torch.bool, device=server.device)
    vals = []
    for p, n in zip(protos, counts):
        s = prototype_math.spm(p.double(), server.double(), n > 0, reported)
        vals.append(s[~torch.isnan(s)])
    v = torch.cat(vals) if vals else torch.empty(0, device=server.device)
    return float(v.mean()) if len(v) else float("nan")
