import numpy as np
import pytest
import torch
import torch.nn.functional as F

from protofl.algorithms.base import split_state
from protofl.algorithms.capabilities import personalized
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
    got = gradient_dissimilarity(model, params, buffers, data, clients, max_per_client=2000)
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


def test_amm_leaves_out_classes_no_client_reported():
    """Class 2 was never reported: its aggregate row is still the zero vector P^0, which
    normalises to 0 and would be the nearest "other class" of class 0 ([0, .5] -> d- = .5)."""
    server = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    client = torch.tensor([[[0.0, 1.0], [1.0, 0.0], [0.0, 0.0]]])
    counts = torch.tensor([[2.0, 3.0, 0.0]])
    reported = torch.tensor([True, True, False])
    amm = aggregate_mean_margin(client, counts, server, reported)
    assert amm == pytest.approx(np.sqrt(2), rel=1e-6)  # d- over classes 0 and 1 only
    everything = aggregate_mean_margin(client, counts, server)
    assert everything == pytest.approx(1.0, rel=1e-6)  # min(sqrt 2, 1): the zero row is nearer


def test_amm_callback_tracks_reported_classes(tiny_digits):
    exp, _ = tiny_digits("fedavg")
    amm = next(cb for cb in exp.callbacks if type(cb).__name__ == "Amm")
    present = torch.as_tensor(exp.data.class_counts.sum(0) > 0)
    assert amm.reported is not None and bool((amm.reported <= present).all())
    assert bool(amm.reported.any())  # the classes of the clients that trained


def onehot(labels: list[int], c: int = 3) -> torch.Tensor:
    """Class scores whose argmax is ``labels``."""
    return F.one_hot(torch.tensor(labels), c).float()


def test_client_figures_by_hand():
    from protofl.metrics.federated import client_figures
    preds = {0: (torch.tensor([0, 1, 1, 1]), onehot([0, 1, 0, 0])),  # 2/4 right
             3: (torch.tensor([2, 2]), onehot([2, 2]))}  # 2/2 right
    out = client_figures(preds, 3, pooled=False)
    assert out == {"local_accuracy": 0.75, "client_accuracy": {"0": 0.5, "3": 1.0},
                   "client_accuracy_std": 0.25, "client_accuracy_worst10": 0.5,
                   "clients_evaluated": 2}
    assert client_figures({}, 3, pooled=True) == {"clients_evaluated": 0}
    pooled = client_figures(preds, 3, pooled=True)
    assert pooled["accuracy"] == pytest.approx(4 / 6) and pooled["local_accuracy"] == 0.75
    assert 0 < pooled["auc"] < 1


def test_spread_by_hand():
    from protofl.metrics.classification import spread
    # 20 clients: the worst tenth is the lowest 2 (0.1 and 0.2); std of 0.1, 0.2, 0.9 x 18
    accs = [0.9] * 18 + [0.2, 0.1]
    mean = (0.9 * 18 + 0.3) / 20
    std = ((18 * (0.9 - mean) ** 2 + (0.2 - mean) ** 2 + (0.1 - mean) ** 2) / 20) ** 0.5
    got = spread(accs)
    assert got["client_accuracy_worst10"] == pytest.approx(0.15)
    assert got["client_accuracy_std"] == pytest.approx(std)
    assert spread([0.4, 0.8, 0.6])["client_accuracy_worst10"] == pytest.approx(0.4)  # >= 1


def test_auc_by_counting_pairs():
    from protofl.metrics.classification import auc
    y = np.array([0, 0, 1, 1, 2])
    s = np.array([[2.0, 0, 0], [0, 1, 0], [1, 0, 0], [0, 3, 0], [0, 0, 5]])
    p = np.exp(s) / np.exp(s).sum(1, keepdims=True)

    def pairs(c: int) -> float:  # P(score of a positive > a negative's), ties count half
        pos, neg = p[y == c, c], p[y != c, c]
        return np.mean([(a > b) + 0.5 * (a == b) for a in pos for b in neg])
    assert auc(y, s) == pytest.approx(np.mean([pairs(c) for c in range(3)]))
    # a class absent from the truth (a 4th column, scored -1e9: probability 0) is left out
    assert auc(y, np.pad(s, ((0, 0), (0, 1)), constant_values=-1e9)) == pytest.approx(auc(y, s))
    # one class only: no AUC
    assert auc(np.array([1, 1]), np.zeros((2, 3))) is None


def test_zero_sample_sizes_mean_off():
    """``metrics.train_loss_samples: 0`` (and every other size set to 0) switches the metric
    off instead of failing inside torch.cat."""
    from protofl.api import run_experiment
    from protofl.config import config_from_dict

    cfg = config_from_dict({"rounds": 1, "checkpoint_every": 0,
                            "data": {"name": "digits", "num_clients": 4},
                            "clients": {"per_round": 2, "local_steps": 1},
                            "metrics": {"train_loss_samples": 0, "dissimilarity_clients": 0}})
    summary = run_experiment(cfg)
    assert summary.get("train_loss") is None and summary.get("dissimilarity") is None
    assert "accuracy" in summary


def _loop_dissimilarity(model, params, buffers, data, clients, max_per_client):
    """The pre-vectorization implementation: one torch.func.grad call per client."""
    from torch.func import functional_call, grad

    def client_loss(p, x, y):
        return F.cross_entropy(functional_call(model, {**p, **buffers}, (x,))[1], y)

    flat, sizes = [], []
    for k in clients.tolist():
        x, y = data.client_train(k)
        gk = grad(client_loss)(params, x[:max_per_client], y[:max_per_client])
        flat.append(torch.cat([v.reshape(-1) for v in gk.values()]).double())
        sizes.append(float(len(data.client_train(k)[1])))
    gs, w = torch.stack(flat), torch.tensor(sizes, dtype=torch.float64)
    mean = (w.unsqueeze(1) * gs).sum(0) / w.sum()
    return float(((gs - mean) ** 2).sum(1).mean())


@pytest.mark.parametrize("conv", [False, True])
def test_vectorized_dissimilarity_equals_the_loop_in_float64(conv):
    from protofl.data.federated import from_client_lists
    from protofl.metrics.federated import client_gradients
    from protofl.models.nets import ConvNet

    g = torch.Generator().manual_seed(0)
    sizes = [3, 17, 9, 40, 1, 12, 25]  # unequal: padded groups, a one-row client
    shape = (1, 6, 6) if conv else (5,)
    xs = [torch.randn(n, *shape, generator=g, dtype=torch.float64) for n in sizes]
    ys = [torch.randint(0, 3, (n,), generator=g) for n in sizes]
    data = from_client_lists("t", 3, xs, ys, local_test_fraction=0.0)
    torch.manual_seed(1)
    model = (ConvNet(shape, 3, (2,), 3, 4) if conv else Mlp(5, 3, hidden=(6,))).double()
    params, buffers = split_state(model)
    clients = np.array([0, 1, 3, 4, 5, 6])
    want = _loop_dissimilarity(model, params, buffers, data, clients, 20)
    for chunk in (1, 30, 10_000):  # one client a group ... all in one group
        got = gradient_dissimilarity(model, params, buffers, data, clients, max_per_client=20,
                                     chunk_rows=chunk)
        assert abs(got - want) <= 1e-10 * max(1.0, abs(want))
    gs = client_gradients(model, params, buffers, [xs[0], xs[3]], [ys[0], ys[3]], chunk_rows=64)
    model.zero_grad()
    F.cross_entropy(model(xs[3])[1], ys[3]).backward()
    assert torch.allclose(gs[1], torch.cat([p.grad.reshape(-1) for p in model.parameters()]),
                          atol=1e-12)


def test_batched_local_accuracy_equals_per_client_scoring():
    from protofl.algorithms.registry import make_algorithm
    from protofl.metrics.federated import client_predictions, scores

    data = synthetic_federation(num_clients=6, seed=3)
    torch.manual_seed(0)
    model = Mlp(60, 10, hidden=(8,)).double()
    data.x_local_test = data.x_local_test.double()
    alg = make_algorithm("fedavg", {}, model, 10)
    state = alg.init_state(model)
    got = client_predictions(alg, model, state, data, {}, batch=7)
    assert sorted(got) == list(range(6))
    for k in range(6):
        x, y = data.client_test(k)
        want = scores(alg, model, state["params"], state["buffers"], state, x, 2048)
        assert torch.equal(got[k][0], y) and torch.equal(got[k][1].argmax(1), want.argmax(1))
    some = client_predictions(alg, model, state, data, {}, batch=7, clients=[4, 1])
    assert sorted(some) == [1, 4] and torch.equal(some[4][1], got[4][1])


def test_personalised_clients_use_their_own_models():
    from protofl.algorithms.registry import make_algorithm
    from protofl.metrics.federated import client_predictions

    data = synthetic_federation(num_clients=4, seed=3)
    torch.manual_seed(0)
    model = Mlp(60, 10, hidden=(8,))
    alg = make_algorithm("fedproto", {}, model, 10)
    assert personalized(alg)
    params, buffers = split_state(model)
    zero = {k: torch.zeros_like(v) for k, v in params.items()}
    state = alg.init_state(model)
    got = client_predictions(alg, model, state, data, {2: {"params": zero, "buffers": buffers}})
    assert list(got) == [0, 1, 2, 3]  # every client is scored
    own = got[2][1].argmax(1)
    assert (own == own[0]).all()  # its own all-zero model: one class
    # a client that has not trained yet: the model it would start from (the initial one)
    x, _ = data.client_test(0)
    want = alg.predict(model, state["init"]["params"], state["init"]["buffers"], state,
                       data.inputs(x)).argmax(1)
    assert torch.equal(got[0][1].argmax(1), want)


def test_sizes_of_zero_switch_figures_off():
    from protofl.algorithms.registry import make_algorithm
    from protofl.metrics.federated import expensive_due, train_loss

    data = synthetic_federation(num_clients=3, seed=0)
    model = Mlp(60, 10, hidden=(8,))
    alg = make_algorithm("fedavg", {}, model, 10)
    state = alg.init_state(model)
    assert train_loss(alg, model, state, data, 0, seed=0) is None
    assert train_loss(alg, model, state, data, 5, seed=0) > 0
    params, buffers = split_state(model)
    assert gradient_dissimilarity(model, params, buffers, data, np.arange(3), 0) is None
    assert gradient_dissimilarity(model, params, buffers, data, np.arange(0)) is None
    assert [expensive_due(t, 3, 10) for t in range(1, 11)] == [
        False, False, True, False, False, True, False, False, True, True]
    assert not any(expensive_due(t, 0, 10) for t in range(1, 11))


def test_exact_dissimilarity_uses_every_client_and_row():
    """``max_per_client=None``: all rows of every client, large clients cut into pieces of
    ``chunk_rows`` rows and summed back (float64, against the per-client loop)."""
    from protofl.data.federated import from_client_lists

    g = torch.Generator().manual_seed(4)
    sizes = [30, 2, 11, 7]
    xs = [torch.randn(n, 5, generator=g, dtype=torch.float64) for n in sizes]
    ys = [torch.randint(0, 3, (n,), generator=g) for n in sizes]
    data = from_client_lists("t", 3, xs, ys, local_test_fraction=0.0)
    torch.manual_seed(2)
    model = Mlp(5, 3, hidden=(6,)).double()
    params, buffers = split_state(model)
    clients = np.arange(4)
    want = _loop_dissimilarity(model, params, buffers, data, clients, 10_000)
    for chunk in (4, 8, 64):
        got = gradient_dissimilarity(model, params, buffers, data, clients, None, chunk)
        assert abs(got - want) <= 1e-10 * max(1.0, abs(want))
    capped = gradient_dissimilarity(model, params, buffers, data, clients, 5)
    assert abs(capped - _loop_dissimilarity(model, params, buffers, data, clients, 5)) < 1e-10


def test_costly_metrics_every_n_rounds_and_the_last():
    from protofl.engine.experiment import Experiment

    cfg = config_for_metrics({"every": 2, "train_loss_samples": 40, "dissimilarity_clients": 2,
                              "dissimilarity_rows": 10}, rounds=3)
    exp = Experiment(cfg)
    records = [exp.step() for _ in range(3)]
    assert ["train_loss" in r for r in records] == [False, True, True]
    assert ["dissimilarity" in r for r in records] == [False, True, True]
    assert all("accuracy" in r and "amm" in r for r in records)
    # every client's local split scored at the costly rounds only (an aggregate model)
    assert ["local_accuracy" in r for r in records] == [False, True, True]
    off = Experiment(config_for_metrics({"every": 0}, rounds=1)).step()
    assert "train_loss" not in off and "dissimilarity" not in off and "accuracy" in off


def test_a_personalised_method_scores_its_clients_every_evaluated_round():
    import dataclasses

    from protofl.engine.experiment import Experiment

    cfg = dataclasses.replace(config_for_metrics({"every": 2}, rounds=3), algorithm="fedproto")
    exp = Experiment(cfg)
    assert all("local_accuracy" in exp.step() for _ in range(3))


def test_a_figure_switched_off_leaves_no_key():
    from protofl.engine.experiment import Experiment

    for metrics in ({"train_loss_samples": 0}, {"dissimilarity_rows": 0},
                    {"dissimilarity_clients": 0}):
        record = Experiment(config_for_metrics(metrics, rounds=1)).step()
        key = "train_loss" if "train_loss_samples" in metrics else "dissimilarity"
        assert key not in record  # not a null in metrics.jsonl


def test_test_metrics_convert_stored_rows_batch_by_batch():
    from protofl.algorithms.registry import make_algorithm
    from protofl.data.federated import from_client_lists
    from protofl.metrics.federated import evaluate

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (50, 1, 4, 4), dtype=torch.uint8, generator=g)
    y = torch.randint(0, 3, (50,), generator=g)
    data = from_client_lists("u8", 3, [x[:30], x[30:]], [y[:30], y[30:]], x, y, 0.0,
                             scale=255.0)
    torch.manual_seed(0)
    model = Mlp(16, 3, hidden=(5,))  # flattens (1, 4, 4) images
    alg = make_algorithm("fedavg", {}, model, 3)
    s = alg.init_state(model)
    args = (alg, model, s["params"], s["buffers"], s)
    lean = evaluate(*args, data.x_test, data.y_test, 3, batch=7, inputs=data.inputs)
    assert lean == evaluate(*args, data.x_test.float() / 255.0, data.y_test, 3, batch=50)


def config_for_metrics(metrics: dict, rounds: int):
    from protofl.config import config_from_dict

    return config_from_dict({"algorithm": "fedavg", "rounds": rounds, "checkpoint_every": 0,
                             "trainer": "vectorized",
                             "data": {"name": "digits", "num_clients": 4},
                             "clients": {"per_round": 2, "local_steps": 1},
                             "metrics": metrics})
