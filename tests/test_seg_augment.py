"""Joint crop/flip: one geometric transform for image and mask, masks never interpolated."""

import pytest
import torch

from protofl.data.seg_augment import CropFlip, crop_flip_params, random_crop_flip, warp_pair
from protofl.errors import ProtoflError


def blocks_mask(n=4, h=24, w=32):
    """Masks of class blocks with a void (255) frame and a void stripe."""
    m = torch.zeros(n, h, w, dtype=torch.uint8)
    m[:, 4:14, 5:15] = 3
    m[:, 10:20, 18:28] = 7
    m[:, :, 16] = 255
    m[:, 0, :] = 255
    return m


def test_same_transform_for_image_and_mask():
    """The image is a coordinate ramp (bilinear resampling of a linear ramp is exact), so the
    warped image tells where each output pixel was sampled from; the mask must hold the
    source label of the nearest source pixel there."""
    n, h, w = 6, 24, 32
    mask = blocks_mask(n, h, w)
    rows, cols = torch.meshgrid(torch.arange(h, dtype=torch.float64),
                                torch.arange(w, dtype=torch.float64), indexing="ij")
    x = torch.stack([cols, rows]).expand(n, 2, h, w).clone()
    gen = torch.Generator().manual_seed(3)
    xa, ma = random_crop_flip(x, mask, gen, CropFlip(scale=(0.3, 0.9)))
    assert xa.shape == x.shape and ma.shape == mask.shape and ma.dtype == torch.uint8
    u, v = xa[:, 0], xa[:, 1]  # source column / row of every output pixel
    safe = ((u - u.floor() - 0.5).abs() > 1e-3) & ((v - v.floor() - 0.5).abs() > 1e-3)
    src = mask[torch.arange(n)[:, None, None], v.round().long(), u.round().long()]
    assert safe.float().mean() > 0.95
    assert torch.equal(ma[safe], src[safe])
    assert not torch.equal(ma, mask)  # something did happen


def test_void_stays_void_and_no_new_labels():
    mask = blocks_mask()
    x = torch.rand(4, 3, 24, 32)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        _, m = random_crop_flip(x, mask, gen, CropFlip(size=(16, 20)))
        assert m.shape == (4, 16, 20)
        assert set(m.unique().tolist()) <= {0, 3, 7, 255}
        assert (m == 255).any()


def test_flip_only_is_exact_and_seeded():
    mask = blocks_mask(2)
    x = torch.rand(2, 3, 24, 32)
    spec = CropFlip(scale=(1.0, 1.0), ratio=(32 / 24, 32 / 24), hflip=1.0)
    xa, ma = random_crop_flip(x, mask, torch.Generator().manual_seed(0), spec)
    assert torch.allclose(xa, x.flip(-1), atol=1e-5)
    assert torch.equal(ma, mask.flip(-1))
    a = random_crop_flip(x, mask, torch.Generator().manual_seed(9))
    b = random_crop_flip(x, mask, torch.Generator().manual_seed(9))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_outside_is_void_and_uint8_images():
    mask = blocks_mask(1)
    x = torch.randint(0, 256, (1, 3, 24, 32), dtype=torch.uint8)
    theta = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 2.0, 0.0]]], dtype=torch.float64)  # zoom out
    xa, ma = warp_pair(x, mask, theta)
    assert xa.dtype == torch.uint8
    assert (ma[:, :3, :] == 255).all() and (ma[:, :, :4] == 255).all()


def test_bad_inputs():
    with pytest.raises(ProtoflError, match="one size"):
        random_crop_flip(torch.rand(2, 3, 8, 8), torch.zeros(2, 8, 9, dtype=torch.uint8),
                         torch.Generator())
    with pytest.raises(ProtoflError, match="crop scale"):
        CropFlip(scale=(0.0, 1.0))
    theta = crop_flip_params(3, 10, 20, CropFlip(), torch.Generator().manual_seed(0))
    assert theta.shape == (3, 2, 3)
