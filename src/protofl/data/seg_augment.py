"""Joint, seeded augmentation of images and their segmentation masks (no torchvision).

One random resized crop and horizontal flip per image is written as an affine map (output
to input coordinates, ``affine_grid``'s convention) and applied to the image (bilinear) and
to its mask (nearest neighbour, so labels are never blended and void stays void). Every
random draw comes from the ``torch.Generator`` passed in.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from protofl.errors import ProtoflError
from protofl.tasks import VOID


@dataclass(frozen=True)
class CropFlip:
    """Ranges of the random resized crop (area fraction, aspect ratio w/h, both drawn
    uniformly, the ratio in log space) and the flip probability; ``size`` is the output
    ``(H, W)`` (None: the input's)."""

    scale: tuple[float, float] = (0.5, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.5
    size: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        lo, hi = self.scale
        if not 0 < lo <= hi <= 1:
            raise ProtoflError(f"crop scale {self.scale}; allowed: 0 < low <= high <= 1")
        if not 0 < self.ratio[0] <= self.ratio[1]:
            raise ProtoflError(f"crop ratio {self.ratio}; allowed: 0 < low <= high")
        if not 0 <= self.hflip <= 1:
            raise ProtoflError(f"flip probability {self.hflip}; allowed: [0, 1]")


def crop_flip_params(n: int, height: int, width: int, spec: CropFlip, gen: torch.Generator
                     ) -> torch.Tensor:
    """``(n, 2, 3)`` float64 affine maps: each samples a random crop (inside the image) and
    flips it horizontally with probability ``spec.hflip``."""
    u = torch.rand(n, 5, generator=gen, dtype=torch.float64)
    area = spec.scale[0] + (spec.scale[1] - spec.scale[0]) * u[:, 0]
    lr = math.log(spec.ratio[0]) + (math.log(spec.ratio[1]) - math.log(spec.ratio[0])) * u[:, 1]
    aspect = torch.exp(lr) * height / width  # in units of the image's own sides
    fw = torch.sqrt(area * aspect).clamp(max=1.0)  # crop width / image width
    fh = torch.sqrt(area / aspect).clamp(max=1.0)
    cx = (1 - fw) * (2 * u[:, 2] - 1)  # crop centre in [-1, 1] coordinates
    cy = (1 - fh) * (2 * u[:, 3] - 1)
    flip = torch.where(u[:, 4] < spec.hflip, -1.0, 1.0).to(torch.float64)
    zero = torch.zeros_like(fw)
    return torch.stack([torch.stack([fw * flip, zero, cx], 1),
                        torch.stack([zero, fh, cy], 1)], 1)


def warp_pair(x: torch.Tensor, mask: torch.Tensor, theta: torch.Tensor,
              size: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Resample images ``x (N, C, H, W)`` (bilinear) and masks ``(N, H, W)`` (nearest)
    through the same affine maps; mask pixels from outside the image are void. uint8 images
    come back as uint8 (rounded)."""
    if x.dim() != 4 or mask.dim() != 3 or x.shape[0] != mask.shape[0] or (
            x.shape[-2:] != mask.shape[-2:]):
        raise ProtoflError(f"joint augmentation needs images (N, C, H, W) and masks (N, H, W) "
                           f"of one size, got {tuple(x.shape)} and {tuple(mask.shape)}")
    h, w = size or tuple(x.shape[-2:])
    out, grid = _warp(x, theta, (h, w))
    shifted = (mask.to(torch.float32) + 1)[:, None]  # 0 marks "outside the image"
    m = F.grid_sample(shifted, grid.float(), mode="nearest", padding_mode="zeros",
                      align_corners=False)[:, 0]
    m = torch.where(m == 0, torch.full_like(m, VOID + 1), m) - 1
    return out, m.round().to(mask.dtype)


def _warp(x: torch.Tensor, theta: torch.Tensor, size: tuple[int, int]
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Images resampled (bilinear, border padding) through ``theta``, and the sampling grid."""
    xf = x.float() if not x.is_floating_point() else x
    grid = F.affine_grid(theta.to(xf.device, xf.dtype), [len(x), 1, *size], align_corners=False)
    out = F.grid_sample(xf, grid, mode="bilinear", padding_mode="border", align_corners=False)
    if x.dtype == torch.uint8:
        out = out.round().clamp(0, 255).to(torch.uint8)
    return out, grid


def crop_flip_transform(spec: CropFlip = CropFlip()) -> Callable[
        [torch.Tensor, torch.Tensor, torch.Generator, torch.Tensor],
        tuple[torch.Tensor, torch.Tensor]]:
    """A client-pipeline transform (``data.pipeline.Transform``; picklable, so it travels to
    the parallel trainer's workers): a random resized crop and flip of every image of a
    batch, drawn from the batch generator; segmentation masks ``(B, H, W)`` go through the
    same map (nearest), class labels ``(B,)`` are unchanged."""
    return functools.partial(_crop_flip, spec)


def _crop_flip(spec: CropFlip, x: torch.Tensor, y: torch.Tensor, gen: torch.Generator,
               counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if len(x) == 0:
        return x, y
    if x.dim() != 4:
        raise ProtoflError(f"crop_flip augmentation needs images (N, C, H, W), got "
                           f"{tuple(x.shape)}")
    theta = crop_flip_params(len(x), x.shape[-2], x.shape[-1], spec, gen)
    if y.dim() == 3:
        return warp_pair(x, y, theta, spec.size)
    return _warp(x, theta, spec.size or tuple(x.shape[-2:]))[0], y


def random_crop_flip(x: torch.Tensor, mask: torch.Tensor, gen: torch.Generator,
                     spec: CropFlip = CropFlip()) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image and its mask cropped, resized back (or to ``spec.size``) and flipped with
    one random draw per pair."""
    if len(x) == 0:
        return x, mask
    theta = crop_flip_params(len(x), x.shape[-2], x.shape[-1], spec, gen)
    return warp_pair(x, mask, theta, spec.size)
