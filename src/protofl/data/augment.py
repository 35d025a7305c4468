"""Seeded, batch-wise image augmentation on tensors (no torchvision).

Every random draw comes from the ``torch.Generator`` passed in, so a batch is augmented the
same way whenever the run is repeated. Images are ``(N, C, H, W)``; anything else (feature
vectors) passes through unchanged. Geometric changes (rotation, flips, scale, shift) are one
affine warp per image through ``affine_grid``/``grid_sample``; colour jitter scales
brightness, contrast and (for 3-channel images) saturation. Values are not clamped, so
standardised inputs stay standardised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AugmentSpec:
    """Ranges of the random transforms (each drawn uniformly per image)."""

    rotation: float = 15.0  # degrees, +-
    hflip: float = 0.5  # probability of a horizontal flip
    vflip: float = 0.5  # probability of a vertical flip
    scale: float = 0.1  # zoom factor in [1 - scale, 1 + scale]
    shift: float = 0.1  # translation, fraction of the image size, +-
    brightness: float = 0.2  # factor in [1 - b, 1 + b]
    contrast: float = 0.2  # factor in [1 - c, 1 + c] around each image's mean
    saturation: float = 0.2  # factor in [1 - s, 1 + s] around the grey image (3 channels)


def _uniform(n: int, lo: float, hi: float, gen: torch.Generator, like: torch.Tensor
             ) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(n, generator=gen).to(like)


def affine_params(n: int, spec: AugmentSpec, gen: torch.Generator, like: torch.Tensor
                  ) -> torch.Tensor:
    """``(n, 2, 3)`` matrices mapping output to input coordinates (``affine_grid``'s
    convention, coordinates in [-1, 1]): rotation, zoom, flips and shift."""
    angle = _uniform(n, -spec.rotation, spec.rotation, gen, like) * (math.pi / 180.0)
    zoom = _uniform(n, 1.0 - spec.scale, 1.0 + spec.scale, gen, like)
    flip_x = torch.where(torch.rand(n, generator=gen).to(like) < spec.hflip, -1.0, 1.0)
    flip_y = torch.where(torch.rand(n, generator=gen).to(like) < spec.vflip, -1.0, 1.0)
    tx = _uniform(n, -2 * spec.shift, 2 * spec.shift, gen, like)  # [-1, 1] spans the image
    ty = _uniform(n, -2 * spec.shift, 2 * spec.shift, gen, like)
    cos, sin = torch.cos(angle) / zoom, torch.sin(angle) / zoom
    theta = torch.stack([torch.stack([cos * flip_x, -sin * flip_y, tx], 1),
                         torch.stack([sin * flip_x, cos * flip_y, ty], 1)], 1)
    return theta


def warp(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Resample images ``x (N, C, H, W)`` through affine maps ``theta (N, 2, 3)``; pixels
    from outside the image are 0."""
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def colour_jitter(x: torch.Tensor, spec: AugmentSpec, gen: torch.Generator) -> torch.Tensor:
    """Random brightness, contrast and (3 channels) saturation per image."""
    n = len(x)
    shape = (n, 1, 1, 1)
    b = _uniform(n, 1 - spec.brightness, 1 + spec.brightness, gen, x).reshape(shape)
    c = _uniform(n, 1 - spec.contrast, 1 + spec.contrast, gen, x).reshape(shape)
    s = _uniform(n, 1 - spec.saturation, 1 + spec.saturation, gen, x).reshape(shape)
    x = x * b
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    x = mean + c * (x - mean)
    if x.shape[1] == 3:
        grey = (0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3])
        x = grey + s * (x - grey)
    return x


def random_augment(x: torch.Tensor, gen: torch.Generator, spec: AugmentSpec = AugmentSpec()
                   ) -> torch.Tensor:
    """Every image of the batch warped and colour-jittered with its own random draw."""
    if x.dim() != 4 or len(x) == 0:
        return x
    return colour_jitter(warp(x, affine_params(len(x), spec, gen, x)), spec, gen)


def class_augment_probability(counts: torch.Tensor) -> torch.Tensor:
    """``p[c] = 1 - n_c / n_max`` (the majority class is never augmented; absent classes 0), in
    float64 (float32 on MPS, which has no float64)."""
    counts = counts.to(torch.float64 if counts.device.type != "mps" else torch.float32)
    top = counts.max().clamp_min(1.0)
    return torch.where(counts > 0, 1.0 - counts / top, torch.zeros_like(counts))


def adaptive_augment(x: torch.Tensor, y: torch.Tensor, counts: torch.Tensor,
                     gen: torch.Generator, spec: AugmentSpec = AugmentSpec()) -> torch.Tensor:
    """Augment each image of class ``c`` with probability ``1 - n_c / n_max`` (``counts`` are
    the client's per-class sample counts); the others are returned unchanged."""
    if x.dim() != 4 or len(x) == 0:
        return x
    p = class_augment_probability(counts)[y].to(x.dtype)
    pick = torch.rand(len(x), generator=gen).to(x) < p
    out = random_augment(x, gen, spec)
    return torch.where(pick.reshape(-1, 1, 1, 1), out, x)
