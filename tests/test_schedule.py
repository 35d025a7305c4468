import numpy as np
import torch

from protofl.engine.schedule import assign_work, local_schedule, sample_clients
from protofl.seeding import np_rng


def test_weighted_sampling_frequencies():
    sizes = np.array([10, 20, 30, 40])
    counts = np.zeros(4)
    for t in range(20000):
        counts[sample_clients(sizes, 1, "weighted", np_rng(0, 0, t))] += 1
    assert np.allclose(counts / counts.sum(), sizes / sizes.sum(), atol=0.01)
    counts[:] = 0
    for t in range(20000):
        counts[sample_clients(sizes, 1, "uniform", np_rng(0, 0, t))] += 1
    assert np.allclose(counts / counts.sum(), 0.25, atol=0.01)


def test_sampling_without_replacement():
    picked = sample_clients(np.arange(1, 11), 10, "weighted", np_rng(1))
    assert sorted(picked.tolist()) == list(range(10))


def test_stragglers_partial_work_or_dropped():
    active = np.arange(10)
    jobs = assign_work(active, 20, 0.5, True, np_rng(3))
    slow = [j for j in jobs if j.straggler]
    assert len(jobs) == 10 and len(slow) == 5
    assert all(1 <= j.units <= 19 for j in slow)
    assert all(j.units == 20 for j in jobs if not j.straggler)
    dropped = assign_work(active, 20, 0.5, False, np_rng(3))
    assert len(dropped) == 5 and not any(j.straggler for j in dropped)
    # the straggler epochs are uniform on 1..E-1
    amounts = [j.units for t in range(3000)
               for j in assign_work(active, 4, 0.5, True, np_rng(9, t)) if j.straggler]
    freq = np.bincount(amounts, minlength=4)[1:] / len(amounts)
    assert np.allclose(freq, 1 / 3, atol=0.02)


def test_local_schedule_epochs_and_steps():
    y = torch.arange(25)
    order = lambda y, g: torch.randperm(len(y), generator=g)  # noqa: E731
    b, _ = local_schedule(order, y, 2, 10, False, torch.Generator().manual_seed(0))
    assert [len(i) for i in b] == [10, 10, 5, 10, 10, 5]
    assert sorted(torch.cat(b[:3]).tolist()) == list(range(25))
    b, _ = local_schedule(order, y, 7, 10, True, torch.Generator().manual_seed(0))
    assert [len(i) for i in b] == [10] * 7
    small, _ = local_schedule(order, torch.arange(4), 3, 10, True,
                              torch.Generator().manual_seed(0))
    assert [len(i) for i in small] == [4, 4, 4]


def test_last_pass_is_the_last_epoch_or_an_epochs_worth_of_steps():
    y = torch.arange(25)
    order = lambda y, g: torch.randperm(len(y), generator=g)  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    b, last = local_schedule(order, y, 2, 10, False, gen)
    assert last == 3 and sorted(torch.cat(b[-last:]).tolist()) == list(range(25))
    assert local_schedule(order, y, 7, 10, True, gen)[1] == 3  # ceil(25 / 10) steps
    assert local_schedule(order, y, 2, 10, True, gen)[1] == 2  # fewer steps than a pass
    assert local_schedule(order, torch.arange(4), 3, 10, True, gen)[1] == 1


def test_steps_cut_the_passes_drawn_in_turn_into_batches():
    """By steps: the batches are one stream of passes, each drawn from the client's generator
    only when the steps reach it (so the generator ends where exactly that many draws leave it)."""
    order = lambda y, g: torch.randperm(len(y), generator=g)  # noqa: E731
    for n, units, b in [(25, 7, 10), (30, 3, 10), (10, 4, 10), (13, 1, 5)]:
        y, gen = torch.arange(n), torch.Generator().manual_seed(n)
        batches, _ = local_schedule(order, y, units, b, True, gen)
        ref = torch.Generator().manual_seed(n)
        passes = [torch.randperm(n, generator=ref) for _ in range(-(-units * b // n))]
        assert torch.equal(torch.cat(batches), torch.cat(passes)[:units * b])
        assert [len(i) for i in batches] == [b] * units
        assert torch.equal(gen.get_state(), ref.get_state())
