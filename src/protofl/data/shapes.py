"""Shapes: an embedded, procedurally generated segmentation set (no download).

Each image holds one object class (one to three instances of it) on a cluttered background,
mirroring the seed's single-class Pascal VOC subset. The eight object classes differ in both
shape and texture (the texture follows the instance's rotation):

==========  ========  ===================  ==========
class       shape     texture              macro
==========  ========  ===================  ==========
disc        disc      solid                round
ring        annulus   concentric bands     round
square      square    horizontal stripes   boxy
diamond     diamond   checkerboard         boxy
triangle    triangle  dots                 pointy
star        5 points  diagonal stripes     pointy
cross       plus      vertical stripes     linear
bar         ellipse   fine grain           linear
==========  ========  ===================  ==========

Each instance has a random size and rotation; its pattern colour is drawn near its class's
hue (eight hues around the colour circle, jitter +-0.03, random saturation and value) and
the texture's ground is the same colour darker, so colour, shape and texture all carry the
class (a macro group's two classes have neighbouring hues). The background is a smooth
random colour field with a faint random sinusoidal grating, pixel noise and a few
distractor strokes of any colour, all labelled background; objects are drawn over them.
Like VOC, a one-pixel band on each object's outline is void (255) unless
``void_edges=False``. Everything is vectorised numpy and deterministic from the seed: the
1,500 images of 48 x 48 take about a second on one core.
"""

from __future__ import annotations

import numpy as np
import torch

from protofl.data.federated import FederatedData
from protofl.data.partition import capped
from protofl.data.segmentation import mask_federation
from protofl.errors import ProtoflError
from protofl.tasks import VOID

SHAPE_CLASSES = ("disc", "ring", "square", "diamond", "triangle", "star", "cross", "bar")
MACRO_NAMES = ("background", "round", "boxy", "pointy", "linear")
MACRO_OF = (1, 1, 2, 2, 3, 3, 4, 4)  # macro index of each object class in SHAPE_CLASSES order
SHAPES_SIZE = 48
SHAPES_TRAIN = 1200
SHAPES_TEST = 300
SHAPES_CLIENTS = 20
MAX_INSTANCES = 3
STROKES = 4
TRAIN_SEED, TEST_SEED = 1, 2  # the set is fixed; data.seed only changes the partition


def _shape(k: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Inside test of object class ``k`` in unit local coordinates (radius 1)."""
    r = np.hypot(a, b)
    if k == 0:
        return r <= 1.0
    if k == 1:
        return (r <= 1.0) & (r >= 0.55)
    if k == 2:
        return np.maximum(np.abs(a), np.abs(b)) <= 0.8
    if k == 3:
        return np.abs(a) + np.abs(b) <= 1.05
    if k == 4:  # equilateral triangle with circumradius 1.1: three half-planes
        inside = np.ones_like(a, dtype=bool)
        for t in (np.pi / 2, np.pi / 2 + 2 * np.pi / 3, np.pi / 2 + 4 * np.pi / 3):
            inside &= a * np.cos(t) + b * np.sin(t) >= -0.55
        return inside
    if k == 5:
        phi = np.arctan2(b, a)
        return r <= 0.45 + 0.6 * ((np.cos(5 * phi) + 1) / 2) ** 2
    if k == 6:
        return ((np.abs(a) <= 0.3) & (np.abs(b) <= 1.0)) | ((np.abs(b) <= 0.3)
                                                              & (np.abs(a) <= 1.0))
    return (a / 1.1) ** 2 + (b / 0.45) ** 2 <= 1.0


def _texture(k: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Pattern (True = pattern colour) of object class ``k`` at local pixel offsets u, v."""
    if k == 0:
        return np.ones_like(u, dtype=bool)
    if k == 1:
        return np.floor(np.hypot(u, v) / 2.0) % 2 == 0
    if k == 2:
        return np.floor(v / 2.0) % 2 == 0
    if k == 3:
        return (np.floor(u / 3.0) + np.floor(v / 3.0)) % 2 == 0
    if k == 4:
        return (u % 4.0 - 2.0) ** 2 + (v % 4.0 - 2.0) ** 2 <= 1.6
    if k == 5:
        return np.floor((u + v) / 2.5) % 2 == 0
    if k == 6:
        return np.floor(u / 2.0) % 2 == 0
    return (np.floor(u) + np.floor(v)) % 2 == 0  # one-pixel grain


def _smooth_field(rng: np.random.Generator, n: int, size: int, cells: int = 4) -> np.ndarray:
    """Random colour fields (n, 3, size, size) in [0, 1], bilinear from a coarse grid."""
    coarse = torch.from_numpy(rng.random((n, 3, cells, cells), dtype=np.float32))
    return torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear",
                                           align_corners=True).numpy()


def _hue_colour(rng: np.random.Generator, hue: np.ndarray) -> np.ndarray:
    """RGB colours (n, 3) near the given hues (jitter +-0.03), saturation and value in
    [0.6, 1]."""
    n = len(hue)
    h = (hue + rng.uniform(-0.03, 0.03, n)) % 1.0
    sat, val = rng.uniform(0.6, 1.0, (2, n))
    k = (np.array([5.0, 3.0, 1.0]) + 6 * h[:, None]) % 6  # the usual HSV-to-RGB formula
    return val[:, None] * (1 - sat[:, None] * np.clip(np.minimum(k, 4 - k), 0, 1))


def generate_shapes(n: int, size: int = SHAPES_SIZE, seed: int = 0, void_edges: bool = True,
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` images: ``(images uint8 (n, 3, S, S), masks uint8 (n, S, S), labels int64 (n,))``.

    Mask values are 0 (background), 1..8 (the object class, ``SHAPE_CLASSES`` order) and 255
    (void outline); ``labels`` is each image's object class (1..8).
    """
    if size < 16:
        raise ProtoflError(f"shapes image size must be >= 16 pixels, got {size}")
    rng = np.random.default_rng(seed)
    s = size / SHAPES_SIZE  # sizes below are in pixels of a 48 x 48 image
    yy, xx = np.meshgrid(np.arange(size, dtype=np.float32), np.arange(size, dtype=np.float32),
                         indexing="ij")
    labels = rng.integers(1, len(SHAPE_CLASSES) + 1, n)

    # background: colour field, faint grating, noise, distractor strokes
    img = 0.25 + 0.5 * _smooth_field(rng, n, size)
    freq = rng.uniform(0.3, 1.2, (n, 1, 1)) / s
    theta = rng.uniform(0, np.pi, (n, 1, 1))
    grating = np.sin(freq * (xx * np.cos(theta) + yy * np.sin(theta)) + rng.uniform(
        0, 2 * np.pi, (n, 1, 1)))
    img += ((0.08 * grating)[:, None] * rng.choice([-1.0, 1.0], (n, 3, 1, 1))).astype(
        np.float32)
    img += 0.04 * rng.standard_normal(img.shape, dtype=np.float32)
    for _ in range(STROKES):
        p0 = rng.uniform(0, size, (n, 2, 1, 1)).astype(np.float32)
        p1 = p0 + rng.normal(0, 12 * s, (n, 2, 1, 1)).astype(np.float32)
        d = p1 - p0
        t = ((xx - p0[:, 0]) * d[:, 0] + (yy - p0[:, 1]) * d[:, 1]) / np.maximum(
            (d ** 2).sum(1), 1e-6)
        t = np.clip(t, 0, 1)
        dist = np.hypot(xx - p0[:, 0] - t * d[:, 0], yy - p0[:, 1] - t * d[:, 1])
        on = dist <= rng.uniform(0.5, 1.5, (n, 1, 1)) * s
        colour = rng.random((n, 3, 1, 1), dtype=np.float32)
        np.copyto(img, np.broadcast_to(colour, img.shape), where=on[:, None])

    # objects: 1..3 instances of the image's class, painted in order
    mask = np.zeros((n, size, size), dtype=np.uint8)
    count = rng.integers(1, MAX_INSTANCES + 1, n)
    for j in range(MAX_INSTANCES):
        radius = rng.uniform(12, 18, n) * s / count ** 0.4  # several instances: smaller
        cx, cy = (rng.uniform(0.2, 0.8, (2, n)) * size)
        angle = rng.uniform(0, 2 * np.pi, n)
        fg = _hue_colour(rng, (labels - 1) / len(SHAPE_CLASSES))  # the class's hue family
        bg = fg * rng.uniform(0.3, 0.55, (n, 1))  # the texture's ground: the same hue, darker
        for k in range(len(SHAPE_CLASSES)):
            idx = np.flatnonzero((labels == k + 1) & (count > j))
            if not len(idx):
                continue
            c, si = np.cos(angle[idx])[:, None, None], np.sin(angle[idx])[:, None, None]
            dx, dy = xx - cx[idx, None, None], yy - cy[idx, None, None]
            u, v = c * dx + si * dy, -si * dx + c * dy
            r = radius[idx, None, None]
            inside = _shape(k, u / r, v / r)
            pattern = _texture(k, u / s, v / s)
            colour = np.where(pattern[:, None], fg[idx, :, None, None],
                              bg[idx, :, None, None]).astype(np.float32)
            sub = img[idx]
            np.copyto(sub, colour, where=inside[:, None])
            img[idx] = sub
            mask[idx] = np.where(inside, k + 1, mask[idx])
    if void_edges:
        obj = mask > 0
        pad = np.pad(obj, ((0, 0), (1, 1), (1, 1)), mode="edge")
        edge = obj & ~(pad[:, :-2, 1:-1] & pad[:, 2:, 1:-1] & pad[:, 1:-1, :-2]
                       & pad[:, 1:-1, 2:])
        mask[edge] = VOID
    images = np.clip(np.rint(img * 255), 0, 255).astype(np.uint8)
    return images, mask, labels.astype(np.int64)


def macro_lut() -> np.ndarray:
    """A 256-entry table mapping shapes mask values to macro values (void stays 255)."""
    lut = np.full(256, VOID, dtype=np.uint8)
    lut[0] = 0
    lut[1:len(SHAPE_CLASSES) + 1] = MACRO_OF
    return lut


def _shapes(cfg, macro: bool) -> FederatedData:
    size = cfg.image_size or SHAPES_SIZE
    x, y, lab = generate_shapes(SHAPES_TRAIN, size, seed=TRAIN_SEED)
    x_test, y_test, lab_test = generate_shapes(SHAPES_TEST, size, seed=TEST_SEED)
    keep = capped(SHAPES_TRAIN, cfg)
    x, y, lab = x[keep], y[keep], lab[keep]
    return mask_federation("shapes_macro" if macro else "shapes",
                           MACRO_NAMES if macro else ("background",) + SHAPE_CLASSES,
                           (x, y, lab), (x_test, y_test, lab_test), cfg, SHAPES_CLIENTS,
                           macro_lut() if macro else None)


def shapes_federation(cfg) -> FederatedData:
    """Shapes, 9 classes (background + 8 objects); Dirichlet(alpha) power-law clients."""
    return _shapes(cfg, macro=False)


def shapes_macro_federation(cfg) -> FederatedData:
    """Shapes with its 5 macro classes (background, round, boxy, pointy, linear)."""
    return _shapes(cfg, macro=True)
