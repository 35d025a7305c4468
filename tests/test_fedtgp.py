"""FedTGP: the adaptive margin by hand (and its cap), the margin loss against a loop, server
training lowers its loss and is seeded, and a 2-round run."""

import math

import numpy as np
import pytest
import torch

from protofl.algorithms.capabilities import personalized
from protofl.algorithms.fedtgp import (
    adaptive_margin,
    generate,
    init_generator,
    margin_loss,
    train_generator,
)
from protofl.algorithms.registry import make_algorithm
from protofl.errors import ProtoflError
from protofl.models.nets import Mlp
from protofl.seeding import SERVER, torch_gen

Q = torch.tensor([[0.0, 0.0], [3.0, 0.0], [0.0, 4.0], [10.0, 10.0]])
PRESENT = torch.tensor([True, True, True, False])


def test_adaptive_margin_by_hand_and_cap():
    # nearest other present class: c0 -> 3 (c1), c1 -> 3 (c0), c2 -> 4 (c0); max = 4;
    # the absent class 3 takes no part
    assert float(adaptive_margin(Q, PRESENT, 100.0)) == pytest.approx(4.0)
    assert float(adaptive_margin(Q * 100, PRESENT, 100.0)) == pytest.approx(100.0)  # 400 capped
    assert float(adaptive_margin(Q, PRESENT, 2.5)) == pytest.approx(2.5)
    one = torch.tensor([True, False, False, False])
    assert float(adaptive_margin(Q, one, 100.0)) == 0.0


def test_margin_loss_matches_loop():
    gen = torch.Generator().manual_seed(0)
    g = init_generator(3, 2, 5, gen)
    p = torch.tensor([[0.5, 1.0], [-1.0, 2.0], [0.0, 0.0]])
    y = torch.tensor([2, 0, 1])
    delta = 0.7
    centres = generate(g)
    total = 0.0
    for i in range(3):
        d = [math.dist(p[i].tolist(), centres[c].tolist()) + (delta if c == y[i] else 0.0)
             for c in range(3)]
        total += d[y[i]] + math.log(sum(math.exp(-v) for v in d))  # CE of the logits -d
    got = float(margin_loss(g, p, y, torch.tensor(delta)))
    assert got == pytest.approx(total / 3, rel=1e-5)


def test_server_training_lowers_loss_and_is_seeded():
    alg = make_algorithm("fedtgp", {"server_epochs": 30}, Mlp(2, 3, hidden=(4, 2)), 3)
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(12, 2, generator=gen) + torch.tensor([[4.0, 0.0], [0.0, 4.0], [-4.0, 0.0]]
                                                          ).repeat(4, 1)
    y = torch.tensor([0, 1, 2]).repeat(4)
    g0 = init_generator(3, 2, 2, torch.Generator().manual_seed(2))
    before = float(margin_loss(g0, p, y, torch.tensor(1.0)))
    g1, hist = train_generator(g0, p, y, torch.tensor(1.0), alg.opts,
                               torch.Generator().manual_seed(3))
    assert float(margin_loss(g1, p, y, torch.tensor(1.0))) < before and hist[-1] < hist[0]
    g2, _ = train_generator(g0, p, y, torch.tensor(1.0), alg.opts,
                            torch.Generator().manual_seed(3))
    assert all(torch.equal(g1[k], g2[k]) for k in g1)


def test_aggregate_seeded_by_round_and_present():
    torch.manual_seed(0)
    model = Mlp(2, 3, hidden=(4, 2))
    alg = make_algorithm("fedtgp", {"server_epochs": 3, "server_batch": 1}, model, 3)
    assert alg.opts.lam == 10.0 and alg.opts.server_epochs == 3 and personalized(alg)
    state = alg.init_state(model)
    up = {"protos": torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]),
          "counts": torch.tensor([2.0, 5.0, 0.0]), "num_samples": torch.tensor(7.0)}
    new, diag = alg.aggregate(state, [up], 1)
    again, _ = alg.aggregate(state, [up], 1)
    later, _ = alg.aggregate(state, [up], 2)
    assert "round" not in new and new["present"].tolist() == [1.0, 1.0, 0.0]
    assert diag["margin"] == pytest.approx(math.sqrt(2.0))
    assert torch.equal(new["protos"], again["protos"])  # same round, same seed: same result
    # the round keys the server's mini-batch order: (the state's seed, SERVER, round)
    want, _ = train_generator(state["generator"], up["protos"][:2], torch.tensor([0, 1]),
                              torch.tensor(math.sqrt(2.0)), alg.opts,
                              torch_gen(int(state["seed"]), SERVER, 2))
    assert all(torch.allclose(later["generator"][k], want[k]) for k in want)
    assert "params" not in new


def test_bad_option():
    with pytest.raises(ProtoflError):
        make_algorithm("fedtgp", {"server_optimizer": "rmsprop"}, Mlp(2, 3), 3)


def test_two_round_digits_run(tiny_digits):
    _, out = tiny_digits("fedtgp", {"server_epochs": 5})
    for key in ("accuracy", "local_accuracy", "amm", "client_loss", "margin"):
        assert np.isfinite(out[key]), key


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_train_generator_is_the_plain_optimizer_loop(optimizer):
    """The server loop (the margin's shift built once, SGD as one in-place update) gives the
    weights of the plain loop: margin_loss, torch.optim, the same batches."""
    from protofl.algorithms.fedtgp import (
        FedTGPOptions,
        init_generator,
        margin_loss,
        train_generator,
    )
    from protofl.algorithms.optimizers import make_optimizer

    g0 = init_generator(3, 4, 5, torch.Generator().manual_seed(0))
    p = torch.randn(7, 4, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0])
    delta = torch.tensor(0.7)
    opts = FedTGPOptions(server_epochs=3, server_lr=0.05, server_batch=3,
                         server_optimizer=optimizer)
    got, history = train_generator(g0, p, y, delta, opts, torch.Generator().manual_seed(2))
    g = {k: v.clone().requires_grad_(True) for k, v in g0.items()}
    opt = make_optimizer(list(g.values()), optimizer, 0.05)
    gen, first = torch.Generator().manual_seed(2), []
    for _ in range(3):
        for idx in torch.randperm(7, generator=gen).split(3):
            loss = margin_loss(g, p[idx], y[idx], delta)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if len(first) < 3:  # the first epoch's batches
                first.append(float(loss.detach()) * len(idx))
    for k in g:
        assert torch.allclose(got[k], g[k].detach(), atol=1e-6), k
    assert len(history) == 3 and history[0] == pytest.approx(sum(first) / 7, rel=1e-5)
