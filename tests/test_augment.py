"""Seeded tensor augmentation: geometry, flips, jitter, adaptive per-class probabilities."""

from __future__ import annotations

import torch

from protofl.data.augment import (
    AugmentSpec,
    adaptive_augment,
    class_augment_probability,
    random_augment,
)

NONE = AugmentSpec(rotation=0.0, hflip=0.0, vflip=0.0, scale=0.0, shift=0.0, brightness=0.0,
                   contrast=0.0, saturation=0.0)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def images(n: int = 4, c: int = 3, h: int = 8, w: int = 8) -> torch.Tensor:
    return torch.rand(n, c, h, w, generator=gen(123))


def test_vectors_pass_through():
    x = torch.randn(5, 60)
    assert random_augment(x, gen()) is x
    assert adaptive_augment(x, torch.zeros(5, dtype=torch.long), torch.tensor([5.0, 1.0]),
                            gen()) is x


def test_no_op_spec_is_identity():
    x = images()
    assert torch.allclose(random_augment(x, gen(), NONE), x, atol=1e-5)


def test_flips_match_tensor_flips():
    x = images()
    h = AugmentSpec(**{**NONE.__dict__, "hflip": 1.0})
    v = AugmentSpec(**{**NONE.__dict__, "vflip": 1.0})
    assert torch.allclose(random_augment(x, gen(), h), x.flip(-1), atol=1e-5)
    assert torch.allclose(random_augment(x, gen(), v), x.flip(-2), atol=1e-5)


def test_brightness_scales_each_image_by_one_factor():
    x = images() + 0.1
    spec = AugmentSpec(**{**NONE.__dict__, "brightness": 0.5})
    out = random_augment(x, gen(), spec)
    ratio = (out / x).flatten(1)
    assert torch.allclose(ratio, ratio[:, :1].expand_as(ratio), atol=1e-4)
    assert ((ratio[:, 0] >= 0.5) & (ratio[:, 0] <= 1.5)).all()
    assert not torch.allclose(ratio[:, 0], torch.ones(len(x)))


def test_seeded_and_batchwise():
    x = images(n=6)
    a, b = random_augment(x, gen(7)), random_augment(x, gen(7))
    c = random_augment(x, gen(8))
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    assert a.shape == x.shape
    # each image gets its own draw: two copies of one image come out different
    twins = x[:1].repeat(2, 1, 1, 1)
    out = random_augment(twins, gen(1))
    assert not torch.allclose(out[0], out[1])


def test_class_probabilities_by_hand():
    p = class_augment_probability(torch.tensor([8.0, 4.0, 0.0, 2.0]))
    assert torch.allclose(p, torch.tensor([0.0, 0.5, 0.0, 0.75], dtype=p.dtype))


def test_adaptive_frequencies_match_probabilities():
    counts = torch.tensor([8.0, 4.0, 2.0])  # p = 0, 0.5, 0.75
    n = 1500
    y = torch.arange(3).repeat_interleave(n)
    x = torch.rand(len(y), 1, 6, 6, generator=gen(3)) + 0.5
    out = adaptive_augment(x, y, counts, gen(4))
    changed = (out - x).flatten(1).abs().amax(1) > 1e-6
    freq = torch.stack([changed[y == c].float().mean() for c in range(3)])
    assert freq[0] == 0  # the majority class is never augmented
    assert abs(freq[1] - 0.5) < 0.05 and abs(freq[2] - 0.75) < 0.05
