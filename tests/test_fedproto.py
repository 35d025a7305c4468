"""FedProto (Tan et al.): the regulariser and the server mean by hand, nearest-prototype
inference, personalised weights, and a 2-round run."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from protofl.algorithms.base import split_state, validate_upload
from protofl.algorithms.capabilities import personalized
from protofl.algorithms.fedproto import nearest_prototype_scores, prototype_regulariser
from protofl.algorithms.registry import make_algorithm
from protofl.errors import ProtoflError
from protofl.models.nets import Mlp
from protofl.testing import client_round, trained


def _alg(lam=1.0):
    torch.manual_seed(0)
    model = Mlp(2, 3, hidden=(4, 2))
    return make_algorithm("fedproto", {"lam": lam}, model, 3), model


def test_regulariser_by_hand():
    z = torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.0, 1.0]])
    y = torch.tensor([0, 1, 2])
    protos = torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 3.0]])
    present = torch.tensor([1.0, 0.0, 1.0])
    # class 0: ((1-0)^2 + (2-0)^2)/2 = 2.5; class 1: no global prototype; class 2: (0+4)/2 = 2
    assert prototype_regulariser(z, y, protos, present).tolist() == [2.5, 0.0, 2.0]


def test_loss_is_ce_plus_lambda_mse():
    alg, model = _alg(lam=1.0)
    assert alg.opts.lam == 1.0 and personalized(alg)
    x = torch.tensor([[0.5, -1.0], [1.0, 2.0], [-1.0, 0.3], [0.2, 0.2]])
    y = torch.tensor([0, 1, 2, 1])
    w = torch.tensor([1.0, 1.0, 1.0, 0.0])
    protos = torch.tensor([[0.1, 0.2], [0.3, -0.4], [9.0, 9.0]])
    ctx = {"protos": protos, "present": torch.tensor([1.0, 1.0, 0.0])}
    params, buffers = split_state(model)
    with torch.no_grad():
        z, logits = model(x)
    ce = F.cross_entropy(logits, y, reduction="none")
    reg = [float(((z[i] - protos[y[i]]) ** 2).mean()) if y[i] != 2 else 0.0 for i in range(4)]
    expected = sum((float(ce[i]) + reg[i]) * float(w[i]) for i in range(4)) / 3
    got = float(alg.loss(model, params, buffers, x, y, w, ctx))
    assert got == pytest.approx(expected, rel=1e-6)


def test_server_mean_over_holding_clients_and_single_holder():
    alg, model = _alg()
    state = alg.init_state(model)
    state["protos"] = torch.tensor([[0.0, 0.0], [0.0, 0.0], [7.0, 7.0]])
    state["present"] = torch.tensor([0.0, 0.0, 1.0])
    a = {"protos": torch.tensor([[1.0, 1.0], [2.0, 2.0], [0.0, 0.0]]),
         "counts": torch.tensor([3.0, 1.0, 0.0]), "num_samples": torch.tensor(4.0)}
    b = {"protos": torch.tensor([[3.0, 5.0], [0.0, 0.0], [0.0, 0.0]]),
         "counts": torch.tensor([1.0, 0.0, 0.0]), "num_samples": torch.tensor(1.0)}
    new, _ = alg.aggregate(state, [a, b], 1)
    # class 0: plain mean over the two holders (not count-weighted: that would be [1.5, 2]);
    # class 1: its only holder's prototype; class 2: nobody holds it, keeps the previous one
    assert new["protos"].tolist() == [[2.0, 3.0], [2.0, 2.0], [7.0, 7.0]]
    assert new["present"].tolist() == [1.0, 1.0, 1.0]
    assert "params" not in new


def test_nearest_prototype_scores_and_fallback():
    z = torch.tensor([[0.0, 0.1], [2.9, 3.0]])
    protos = torch.tensor([[0.0, 0.0], [3.0, 3.0], [0.0, 0.1]])
    s = nearest_prototype_scores(z, protos, torch.tensor([1.0, 1.0, 0.0]))
    assert s.argmax(1).tolist() == [0, 1]  # class 2 is nearer to row 0 but has no prototype
    alg, model = _alg()
    state = alg.init_state(model)
    params, buffers = split_state(model)
    x = torch.randn(3, 2)
    with torch.no_grad():
        assert torch.equal(alg.predict(model, params, buffers, state, x), model(x)[1])


def test_personal_weights_and_upload():
    alg, model = _alg()
    state = alg.init_state(model)
    glob = alg.broadcast(state)
    start = alg.local_start(glob, {})
    assert all(torch.equal(start["params"][k], v) for k, v in state["init"]["params"].items())
    params = {k: v + 1.0 for k, v in start["params"].items()}
    x, y = torch.randn(5, 2), torch.tensor([0, 0, 1, 1, 1])
    c = client_round(alg, glob, x, y, model=model)
    up, own = alg.client_end(trained(c, params, start["buffers"]))
    validate_upload(up, alg.upload_spec())
    assert "params" not in up and up["counts"].tolist() == [2.0, 3.0, 0.0]
    again = alg.local_start(glob, own)
    assert all(torch.equal(again["params"][k], params[k]) for k in params)


def test_bad_option():
    with pytest.raises(ProtoflError):
        _alg(lam=-1.0)


def test_two_round_digits_run(tiny_digits):
    exp, out = tiny_digits("fedproto")
    for key in ("accuracy", "local_accuracy", "amm", "client_loss"):
        assert np.isfinite(out[key]), key
    assert "params" not in exp.state and all("params" in s for s in exp.client_states.values())


@pytest.mark.parametrize("name", ["fedproto", "fedtgp"])
def test_personalised_evaluation_covers_every_client(name):
    """After round 1 (2 of 6 clients trained) every client is scored: the untrained ones with
    the weights they would start from (the common initial model) and the global prototypes."""
    from protofl.config import config_from_dict
    from protofl.engine.experiment import Experiment
    from protofl.metrics.federated import client_predictions, scores

    cfg = config_from_dict({"algorithm": name, "rounds": 1, "checkpoint_every": 0,
                            "data": {"name": "digits", "num_clients": 6},
                            "clients": {"per_round": 2, "local_steps": 2},
                            "metrics": {"dissimilarity_clients": 0, "train_loss_samples": 0},
                            "algo": {"server_epochs": 2} if name == "fedtgp" else {}})
    exp = Experiment(cfg)
    record = exp.step()
    scored = [k for k in range(6) if len(exp.data.client_test(k)[1])]
    assert len(exp.client_states) == 2 and len(scored) > 2
    assert record["clients_evaluated"] == len(scored)
    assert sorted(map(int, record["client_accuracy"])) == scored
    preds = client_predictions(exp.alg, exp.alg.model, exp.state, exp.data, exp.client_states)
    untrained = next(k for k in scored if k not in exp.client_states)
    x, _ = exp.data.client_test(untrained)
    init = exp.state["init"]
    expected = scores(exp.alg, exp.alg.model, init["params"], init["buffers"], exp.state,
                      exp.data.inputs(x), 64).argmax(1)
    assert torch.equal(preds[untrained][1].argmax(1), expected)


def test_clients_evaluated_for_a_global_model(tiny_digits):
    exp, out = tiny_digits("fedavg")
    assert out["clients_evaluated"] == sum(
        1 for k in range(exp.data.num_clients) if len(exp.data.client_test(k)[1]))


def test_pass_sums_by_hand():
    from protofl.algorithms.fedproto import pass_sums

    z = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    y = torch.tensor([0, 1, 0, 0])
    w = torch.tensor([1.0, 1.0, 1.0, 0.0])  # the last row is padding
    got = pass_sums(z, y, w, 3)
    assert got["proto_sums"].tolist() == [[6.0, 8.0], [3.0, 4.0], [0.0, 0.0]]
    assert got["proto_counts"].tolist() == [2.0, 1.0, 0.0]


def _one_round(proto_pass, lr, trainer="sequential"):
    """One client (6 rows, 2 classes), batch 2, one epoch of SGD; (upload, batches, rc)."""
    from protofl.data.federated import from_client_lists
    from protofl.data.pipeline import shuffled
    from protofl.engine.schedule import Job, local_schedule
    from protofl.engine.train import LocalSetup, RoundContext, SequentialTrainer
    from protofl.seeding import ORDER, torch_gen

    torch.manual_seed(0)
    model = Mlp(2, 2, hidden=(3, 2))
    alg = make_algorithm("fedproto", {"lam": 1.0, "proto_pass": proto_pass}, model, 2)
    x = torch.tensor([[1.0, 0.0], [0.5, 0.2], [0.9, -0.3], [0.0, 1.0], [-0.2, 0.8],
                      [0.3, 0.7]])
    y = torch.tensor([0, 0, 0, 1, 1, 1])
    data = from_client_lists("toy", 2, [x], [y], local_test_fraction=0.0)
    state = alg.init_state(model)
    state["protos"] = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    state["present"] = torch.tensor([1.0, 1.0])
    setup = LocalSetup(2, False, "sgd", lr, seed=3)
    rc = RoundContext(alg, alg.broadcast(state), [Job(0, 1)], data, {}, setup, 1)
    if trainer == "sequential":
        up = SequentialTrainer().train(rc)[0].upload
    else:
        from protofl.engine.vectorized import VectorizedTrainer

        up = VectorizedTrainer().train(rc)[0].upload
    xs, ys = data.client_train(0)
    batches, _ = local_schedule(shuffled, ys, 1, 2, False, torch_gen(3, ORDER, 1, 0))
    return up, batches, (alg, model, state, xs, ys)


def test_training_pass_prototypes_replayed_by_hand():
    """``proto_pass: training``: each batch's features under the weights of its own step
    (replayed here: SGD by hand), averaged per class; ``after``: the trained model's means."""
    lr = 0.5
    got, batches, (alg, model, state, x, y) = _one_round("training", lr)
    after, _, _ = _one_round("after", lr)
    params, buffers = split_state(model)
    ctx = {"protos": state["protos"], "present": state["present"]}
    sums, counts = torch.zeros(2, 2), torch.zeros(2)
    for idx in batches:
        p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        loss = alg.loss(model, p, buffers, x[idx], y[idx], torch.ones(len(idx)), ctx)
        grads = torch.autograd.grad(loss, list(p.values()))
        with torch.no_grad():
            z, _ = torch.func.functional_call(model, {**p, **buffers}, (x[idx],))
            sums.index_add_(0, y[idx], z)
            counts += torch.bincount(y[idx], minlength=2).float()
        params = {k: (v - lr * g).detach() for (k, v), g in zip(p.items(), grads)}
    assert counts.tolist() == [3.0, 3.0] and got["counts"].tolist() == [3.0, 3.0]
    assert torch.allclose(got["protos"], sums / counts.unsqueeze(1), atol=1e-6)
    with torch.no_grad():
        z, _ = torch.func.functional_call(model, {**params, **buffers}, (x,))
    final = torch.stack([z[y == c].mean(0) for c in range(2)])
    assert torch.allclose(after["protos"], final, atol=1e-6)
    assert not torch.allclose(got["protos"], after["protos"], atol=1e-3)


def test_training_pass_vectorized_matches_sequential():
    seq, _, _ = _one_round("training", 0.5)
    vec, _, _ = _one_round("training", 0.5, trainer="vectorized")
    assert torch.allclose(seq["protos"], vec["protos"], atol=1e-6)
    assert torch.equal(seq["counts"], vec["counts"])


def test_training_pass_needs_the_trainer_sums():
    alg, model = _alg()
    alg.opts.proto_pass = "training"
    params, buffers = split_state(model)
    with pytest.raises(ProtoflError, match="last-pass sums"):
        c = client_round(alg, {}, torch.zeros(2, 2), torch.tensor([0, 1]), model=model)
        alg.client_end(trained(c, params, buffers))
