"""Reading image files and arrays as channels-first pixels (with Pillow).

Datasets keep the 8-bit pixels (``ImageRows``, ``ArrayRows``: uint8 rows decoded straight
into the split arrays, turned into [0, 1] floats per batch by ``FederatedData.inputs``);
``read_image``/``read_images``/``resize_array`` give float32 in [0, 1] directly. Every failure
(missing file, corrupt or truncated image) is a ProtoflError naming the file.
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


PIXEL_MAX = 255.0  # FederatedData.scale of 8-bit images
# FederatedData.mean/std of the segmentation sets: the ImageNet channel statistics that a
# pretrained MobileNetV2 encoder (model.pretrained) was trained with
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
MODES = {"RGB": 3, "L": 1}
GREY_MODES = ("1", "L", "LA", "I", "I;16", "F")  # Pillow modes decoded as "L"


def read_image(path: str | Path, size: int | tuple[int, int] | None = None,
               mode: str = "RGB") -> np.ndarray:
    """One image as a (C, H, W) float32 array in [0, 1]; resized (bilinear) to ``size``."""
    return _to_float(read_pixels(path, size, mode))


def read_pixels(path: str | Path, size: int | tuple[int, int] | None = None,
                mode: str = "RGB") -> np.ndarray:
    """One image as a (C, H, W) uint8 array; resized (bilinear, on the 8-bit pixels) to
    ``size``.

    ``mode`` is Pillow's: "RGB" (3 channels) or "L" (1 channel). A JPEG much larger than
    ``size`` is decoded at a reduced DCT scale first (Pillow's draft mode, ~1.5x faster).
    """
    if mode not in MODES:
        raise ProtoflError(f"image mode {mode!r} is not supported; allowed: RGB, L")
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
    a = np.array(im)
    return a[None] if a.ndim == 2 else a.transpose(2, 0, 1).copy()


class ImageRows:
    """Image files as the rows of a (N, C, H, W) uint8 source, decoded when a dataset builder
    fills its split arrays (``FederatedData``'s ``Rows``); all must share one shape unless
    ``size`` resizes them."""

    dtype = torch.uint8

    def __init__(self, paths: Sequence[str | Path], size: int | tuple[int, int] | None,
                 mode: str = "RGB"):
        self.paths, self.size, self.mode = list(paths), size, mode
        self._shape: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def row_shape(self) -> tuple[int, ...]:
        if self._shape is None:
            if self.size is not None or not self.paths:
                h, w = _hw(self.size) if self.size is not None else (0, 0)
                self._shape = (MODES.get(self.mode, 3), h, w)
            else:
                self._shape = read_pixels(self.paths[0], None, self.mode).shape
        return self._shape

    def fill(self, index: np.ndarray, out: torch.Tensor) -> None:
        want = self.row_shape
        for j, i in enumerate(np.asarray(index).tolist()):
            a = read_pixels(self.paths[i], self.size, self.mode)
            if a.shape != want:
                raise ProtoflError(f"image file {self.paths[i]} has shape {a.shape[1:]}, the "
                                   f"first image {want[1:]}; set data.image_size to resize them")
            out[j] = torch.from_numpy(a)


class ArrayRows:
    """A uint8 stack (N, H, W) or (N, H, W, 3) as the rows of a (N, C, H', W') uint8 source,
    resized (bilinear, as Pillow does on 8-bit images) to ``size`` row by row."""

    dtype = torch.uint8

    def __init__(self, images: np.ndarray, size: int | tuple[int, int] | None):
        if images.ndim == 3:
            images = images[..., None]
        if images.ndim != 4 or images.shape[-1] not in (1, 3) or images.dtype != np.uint8:
            raise ProtoflError(f"image array has shape {images.shape} ({images.dtype}); "
                               "expected uint8 (N, H, W) or (N, H, W, 3)")
        self.images = images
        _, h, w, c = images.shape
        self.target = (h, w) if size is None else _hw(size)
        self.row_shape = (c, *self.target)

    def __len__(self) -> int:
        return len(self.images)

    def fill(self, index: np.ndarray, out: torch.Tensor) -> None:
        index = np.asarray(index, dtype=np.int64)
        if self.target == self.images.shape[1:3]:
            for a in range(0, len(index), 4096):
                chunk = self.images[index[a:a + 4096]].transpose(0, 3, 1, 2)
                out[a:a + len(chunk)] = torch.from_numpy(np.ascontiguousarray(chunk))
            return
        Image = _pil()
        for j, i in enumerate(index.tolist()):
            a = self.images[i]
            im = _resize(Image.fromarray(np.ascontiguousarray(a[..., 0] if a.shape[-1] == 1
                                                              else a)), self.target)
            b = np.array(im)
            out[j] = torch.from_numpy(b[None] if b.ndim == 2 else b.transpose(2, 0, 1).copy())


def from_pil(im, size: int | tuple[int, int] | None = None, mode: str = "RGB") -> np.ndarray:
    """A Pillow image as a (C, H, W) float32 array in [0, 1], converted to ``mode`` and
    resized (bilinear) to ``size``."""
    im = im.convert(mode)
    if size is not None:
        im = _resize(im, size)
    a = np.asarray(im)
    return _to_float(a[None] if a.ndim == 2 else a.transpose(2, 0, 1))


def read_images(paths: Sequence[str | Path], size: int | tuple[int, int] | None,
                mode: str = "RGB") -> torch.Tensor:
    """Many images, all resized to ``size`` (required to stack unless they agree), as one
    (N, C, H, W) float32 tensor in [0, 1]."""
    rows = ImageRows(paths, size, mode)
    out = torch.empty((len(rows), *rows.row_shape), dtype=torch.uint8)
    rows.fill(np.arange(len(rows)), out)
    return out.float().div_(PIXEL_MAX)


def resize_array(images: np.ndarray, size: int | tuple[int, int] | None) -> torch.Tensor:
    """A uint8 stack (N, H, W) or (N, H, W, 3) as (N, C, H', W') float32 in [0, 1]."""
    rows = ArrayRows(images, size)
    out = torch.empty((len(rows), *rows.row_shape), dtype=torch.uint8)
    rows.fill(np.arange(len(rows)), out)
    return out.float().div_(PIXEL_MAX)


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
