"""Reading image files and arrays into channels-first float tensors in [0, 1] (with Pillow).

Every failure (missing file, corrupt or truncated image) is a ProtoflError naming the file.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from protofl.errors import ProtoflError


def _pil():
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a dependency
        raise ProtoflError("reading images needs Pillow: pip install pillow") from None
    return Image


def read_image(path: str | Path, size: int | tuple[int, int] | None = None,
               mode: str = "RGB") -> np.ndarray:
    """One image as a (C, H, W) float32 array in [0, 1]; resized (bilinear) to ``size``.

    ``mode`` is Pillow's: "RGB" (3 channels) or "L" (1 channel). A JPEG much larger than
    ``size`` is decoded at a reduced DCT scale first (Pillow's draft mode, ~1.5x faster).
    """
    Image = _pil()
    path = Path(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. TIFF metadata warnings
            with Image.open(path) as im:
                if size is not None and im.format == "JPEG":
                    h, w = _hw(size)  # decode at the smallest DCT scale still >= the target
                    im.draft(mode, (w, h))
                im.load()
                im = im.convert(mode)
    except FileNotFoundError:
        raise ProtoflError(f"image file {path} does not exist") from None
    except Exception as e:  # Pillow raises many types on damaged files (TypeError, ...)
        raise ProtoflError(f"image file {path} cannot be read ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else 'corrupt'})") from None
    if size is not None:
        im = _resize(im, size)
    return _to_chw(np.asarray(im))


def from_pil(im, size: int | tuple[int, int] | None = None, mode: str = "RGB") -> np.ndarray:
    """A Pillow image as a (C, H, W) float32 array in [0, 1], converted to ``mode`` and
    resized (bilinear) to ``size``."""
    im = im.convert(mode)
    if size is not None:
        im = _resize(im, size)
    return _to_chw(np.asarray(im))


def read_images(paths: Sequence[str | Path], size: int | tuple[int, int] | None,
                mode: str = "RGB") -> torch.Tensor:
    """Many images, all resized to ``size`` (required to stack unless they agree), as one
    (N, C, H, W) float32 tensor, filled in place to keep the peak memory at one copy."""
    if not paths:
        c = 1 if mode == "L" else 3
        h, w = _hw(size) if size is not None else (0, 0)
        return torch.zeros((0, c, h, w))
    first = read_image(paths[0], size, mode)
    out = torch.empty((len(paths), *first.shape))
    out[0] = torch.from_numpy(first)
    for i, p in enumerate(paths[1:], start=1):
        a = read_image(p, size, mode)
        if a.shape != first.shape:
            raise ProtoflError(f"image file {p} has shape {a.shape[1:]}, the first image "
                               f"{first.shape[1:]}; set data.image_size to resize them")
        out[i] = torch.from_numpy(a)
    return out


def resize_array(images: np.ndarray, size: int | tuple[int, int] | None) -> torch.Tensor:
    """A uint8 stack (N, H, W) or (N, H, W, 3) as (N, C, H', W') float32 in [0, 1]."""
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4 or images.shape[-1] not in (1, 3):
        raise ProtoflError(f"image array has shape {images.shape}; expected (N, H, W) or "
                           "(N, H, W, 3)")
    n, h, w, c = images.shape
    if size is None or _hw(size) == (h, w):
        return torch.from_numpy(_to_float(images).transpose(0, 3, 1, 2).copy())
    Image = _pil()
    th, tw = _hw(size)
    out = torch.empty((n, c, th, tw))
    for i in range(n):
        a = images[i, ..., 0] if c == 1 else images[i]
        im = _resize(Image.fromarray(np.ascontiguousarray(a)), size)
        out[i] = torch.from_numpy(_to_chw(np.asarray(im)))
    return out


def _hw(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def _resize(im, size: int | tuple[int, int]):
    h, w = _hw(size)
    if im.size == (w, h):
        return im
    return im.resize((w, h), resample=_pil().Resampling.BILINEAR)


def _to_float(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.uint8:
        return a.astype(np.float32) / 255.0
    if a.dtype == np.uint16:
        return a.astype(np.float32) / 65535.0
    return a.astype(np.float32)


def _to_chw(a: np.ndarray) -> np.ndarray:
    a = _to_float(a)
    if a.ndim == 2:
        return a[None]
    return a.transpose(2, 0, 1).copy()
