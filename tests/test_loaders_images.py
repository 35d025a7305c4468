"""Shared image reading: values, resizing, JPEG draft decoding and errors naming the file."""

import numpy as np
import pytest
from PIL import Image

from protofl.data.images import read_image, read_images, resize_array
from protofl.errors import ProtoflError


def test_read_png_exact_and_grey(tmp_path):
    a = np.random.default_rng(0).integers(0, 256, (5, 7, 3)).astype(np.uint8)
    Image.fromarray(a).save(tmp_path / "a.png")
    x = read_image(tmp_path / "a.png")
    assert x.shape == (3, 5, 7) and x.dtype == np.float32
    np.testing.assert_allclose(x, a.transpose(2, 0, 1) / 255.0, rtol=1e-6)
    g = read_image(tmp_path / "a.png", size=(4, 6), mode="L")
    assert g.shape == (1, 4, 6)


def test_jpeg_draft_close_to_full_decode(tmp_path):
    yy, xx = np.mgrid[0:96, 0:128]
    a = np.stack([xx * 2, yy * 2, (xx + yy)], -1).astype(np.uint8)  # smooth ramps
    Image.fromarray(a).save(tmp_path / "big.jpg", quality=95)
    x = read_image(tmp_path / "big.jpg", 16)
    ref = Image.open(tmp_path / "big.jpg").convert("RGB").resize((16, 16),
                                                                 Image.Resampling.BILINEAR)
    ref = np.asarray(ref, np.float32).transpose(2, 0, 1) / 255.0
    assert x.shape == (3, 16, 16)
    assert np.abs(x - ref).max() < 0.05


def test_errors_name_the_file(tmp_path):
    (tmp_path / "bad.jpg").write_bytes(b"\xff\xd8\xff garbage")
    with pytest.raises(ProtoflError, match="bad.jpg"):
        read_image(tmp_path / "bad.jpg", 8)
    with pytest.raises(ProtoflError, match="gone.png.*does not exist"):
        read_image(tmp_path / "gone.png")
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "s.png")
    Image.fromarray(np.zeros((5, 4, 3), np.uint8)).save(tmp_path / "t.png")
    with pytest.raises(ProtoflError, match="t.png"):
        read_images([tmp_path / "s.png", tmp_path / "t.png"], None)
    assert read_images([tmp_path / "s.png", tmp_path / "t.png"], 3).shape == (2, 3, 3, 3)


def test_resize_array_matches_pillow():
    a = np.random.default_rng(1).integers(0, 256, (3, 9, 9)).astype(np.uint8)
    x = resize_array(a, 4)
    assert x.shape == (3, 1, 4, 4)
    for i in range(3):
        ref = np.asarray(Image.fromarray(a[i]).resize((4, 4), Image.Resampling.BILINEAR))
        np.testing.assert_allclose(x[i, 0].numpy(), ref / 255.0, rtol=1e-6)
    np.testing.assert_allclose(resize_array(a, None)[:, 0].numpy(), a / 255.0, rtol=1e-6)
    with pytest.raises(ProtoflError, match="shape"):
        resize_array(np.zeros((2, 3, 3, 2), np.uint8), 4)
