import numpy as np
import pytest
import torch
import torch.nn.functional as F

from protofl.algorithms.base import split_state
from protofl.data.synthetic import synthetic_federation
from protofl.metrics.classification import report
from protofl.metrics.federated import aggregate_mean_margin, gradient_dissimilarity
from protofl.models.nets import Mlp


def test_report_against_sklearn():
    from sklearn.metrics import (
        balanced_accuracy_score,
        confusion_matrix,
        f1_score,
        precision_score,
        recall_score,
    )
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, 200)
    p = np.where(rng.random(200) < 0.6, y, rng.integers(0, 4, 200))
    r = report(y, p, 5)  # class 4 absent everywhere
    assert np.array_equal(np.array(r["confusion"])[:4, :4], confusion_matrix(y, p))
    assert r["balanced_accuracy"] == pytest.approx(balanced_accuracy_score(y, p))
    for avg in ("weighted", "macro"):
        assert r[f"precision_{avg}"] == pytest.approx(precision_score(y, p, average=avg))
        assert r[f"recall_{avg}"] == pytest.approx(recall_score(y, p, average=avg))
        assert r[f"f1_{avg}"] == pytest.approx(f1_score(y, p, average=avg))


def test_gradient_dissimilarity_against_autograd_loop():
    torch.manual_seed(0)
    data = synthetic_federation(num_clients=4, seed=0)
    model = Mlp(60, 10, hidden=(8,))
    params, buffers = split_state(model)
    clients = np.arange(4)
    got = gradient_dissimilarity(model, params, buffers, data, clients)
    grads, sizes = [], []
    for k in clients:
        model.zero_grad()
        x, y = data.client_train(int(k))
        F.cross_entropy(model(x[:2000])[1], y[:2000]).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double())
        sizes.append(len(y))
    g = torch.stack(grads)
    w = torch.tensor(sizes, dtype=torch.float64)
    mean = (w[:, None] * g).sum(0) / w.sum()
    want = np.mean([float(((gk - mean) ** 2).sum()) for gk in g])
    assert got == pytest.approx(want, rel=1e-5)


def test_amm_by_hand():
    # one client, classes 0 and 1 present; its prototypes equal the aggregate -> d+ = 0,
    # d- = distance of the normalised class vectors [0, 1] and [1, 0] = sqrt(2)
    server = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    amm = aggregate_mean_margin(server[None], torch.tensor([[2.0, 3.0]]), server)
    assert amm == pytest.approx(np.sqrt(2), rel=1e-6)


def test_client_figures_by_hand():
    from protofl.metrics.federated import client_figures
    preds = {0: (torch.tensor([0, 1, 1, 1]), torch.tensor([0, 1, 0, 0])),  # 2/4 right
             3: (torch.tensor([2, 2]), torch.tensor([2, 2]))}  # 2/2 right
    out = client_figures(preds, 3, pooled=False)
    assert out == {"local_accuracy": 0.75, "client_accuracy": {"0": 0.5, "3": 1.0},
                   "clients_evaluated": 2}
    assert client_figures({}, 3, pooled=True) == {"clients_evaluated": 0}
    pooled = client_figures(preds, 3, pooled=True)
    assert pooled["accuracy"] == pytest.approx(4 / 6) and pooled["local_accuracy"] == 0.75
