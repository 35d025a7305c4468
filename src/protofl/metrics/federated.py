"""Per-round figures of the aggregate model: test accuracy and loss, local accuracy, training
loss, gradient dissimilarity and the aggregate mean margin (AMM)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad

from protofl.algorithms import prototype_math
from protofl.algorithms.base import Algorithm, Tensors
from protofl.data.federated import FederatedData
from protofl.metrics.classification import report
from protofl.models.nets import ProtoNet


@torch.no_grad()
def scores(alg: Algorithm, model: ProtoNet, params: Tensors, buffers: Tensors, state: Tensors,
           x: torch.Tensor, batch: int) -> torch.Tensor:
    model.eval()
    return torch.cat([alg.predict(model, params, buffers, state, x[i:i + batch])
                      for i in range(0, len(x), batch)])


def evaluate(alg: Algorithm, model: ProtoNet, params: Tensors, buffers: Tensors,
             state: Tensors, x: torch.Tensor, y: torch.Tensor, num_classes: int,
             batch: int = 2048) -> dict:
    """Classification report plus mean cross-entropy of the class scores."""
    if len(y) == 0:
        return {}
    s = scores(alg, model, params, buffers, state, x, batch)
    out = report(y.numpy(), s.argmax(1).numpy(), num_classes)
    out["loss"] = float(F.cross_entropy(s, y))
    return out


def client_predictions(alg: Algorithm, model: ProtoNet, state: Tensors, data: FederatedData,
                       client_states: dict[int, Tensors], batch: int = 2048,
                       clients: list[int] | None = None
                       ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``client -> (labels, predictions)`` on each client's own local test split (all clients,
    or ``clients``), with the weights ``alg.eval_weights`` gives it (the aggregate model's;
    personalised methods: the client's own, or the one it would start from). Clients without
    test samples (or weights) are left out."""
    out = {}
    for k in range(data.num_clients) if clients is None else clients:
        x, y = data.client_test(k)
        weights = alg.eval_weights(state, client_states.get(k, {}))
        if len(y) == 0 or weights is None:
            continue
        out[k] = (y, scores(alg, model, weights["params"], weights["buffers"], state,
                            data.inputs(x), batch).argmax(1))
    return out


def client_figures(preds: dict[int, tuple[torch.Tensor, torch.Tensor]], num_classes: int,
                   pooled: bool) -> dict:
    """``local_accuracy`` (mean over clients), ``client_accuracy`` (per client, by id) and
    ``clients_evaluated`` (how many clients those figures cover); with ``pooled``, also the
    classification report of all clients' predictions together (how personalised methods are
    scored)."""
    if not preds:
        return {"clients_evaluated": 0}
    ks = sorted(preds)
    accs = [float((preds[k][1] == preds[k][0]).float().mean()) for k in ks]
    out = report(torch.cat([preds[k][0] for k in ks]).numpy(),
                 torch.cat([preds[k][1] for k in ks]).numpy(), num_classes) if pooled else {}
    out["local_accuracy"] = float(np.mean(accs))
    out["client_accuracy"] = dict(zip(map(str, ks), accs))
    out["clients_evaluated"] = len(ks)
    return out


def train_loss(alg: Algorithm, model: ProtoNet, state: Tensors, data: FederatedData,
               max_samples: int, seed: int, batch: int = 2048) -> float:
    """Cross-entropy of the aggregate model over (a seeded sample of) all training data."""
    n = len(data.y_train)
    idx = torch.arange(n) if n <= max_samples else torch.from_numpy(
        np.sort(np.random.default_rng(seed).choice(n, max_samples, replace=False)))
    weights = alg.global_weights(state)
    s = scores(alg, model, weights["params"], weights["buffers"], state,
               data.inputs(data.x_train[idx]), batch)
    return float(F.cross_entropy(s, data.y_train[idx]))


def gradient_dissimilarity(model: ProtoNet, params: Tensors, buffers: Tensors,
                           data: FederatedData, clients: np.ndarray,
                           max_per_client: int = 2000) -> float:
    """``(1/|K|) sum_k ||grad L_k(W) - grad L(W)||^2`` with ``grad L = sum n_k grad L_k / sum
    n_k`` over the given clients (cross-entropy at the aggregate weights)."""

    def client_loss(p, x, y):
        _, logits = functional_call(model, {**p, **buffers}, (x,))
        return F.cross_entropy(logits, y)

    g = grad(client_loss)
    model.eval()
    flat, sizes = [], []
    for k in clients.tolist():
        x, y = data.client_train(k)
        x, y = data.inputs(x[:max_per_client]), y[:max_per_client]
        gk = g(params, x, y)
        flat.append(torch.cat([v.reshape(-1) for v in gk.values()]).double())
        sizes.append(float(len(data.client_train(k)[1])))
    gs = torch.stack(flat)
    w = torch.tensor(sizes, dtype=torch.float64)
    mean = (w.unsqueeze(1) * gs).sum(0) / w.sum()
    return float(((gs - mean) ** 2).sum(1).mean())


def aggregate_mean_margin(protos: torch.Tensor, counts: torch.Tensor, server: torch.Tensor
                          ) -> float:
    """AMM: mean over clients and their present classes of SPM(P_k, P) against the aggregate
    prototypes ``server`` (all classes present). ``protos (K, C, d)``, ``counts (K, C)``."""
    everything = torch.ones(server.shape[0], dtype=torch.bool)
    vals = []
    for p, n in zip(protos, counts):
        s = prototype_math.spm(p.double(), server.double(), n > 0, everything)
        vals.append(s[~torch.isnan(s)])
    v = torch.cat(vals) if vals else torch.empty(0)
    return float(v.mean()) if len(v) else float("nan")
