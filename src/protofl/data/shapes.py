"""Shapes: an embedded, procedurally generated segmentation set (no download).

Each image holds one object class (one to three instances of it) on a cluttered background,
mirroring the seed's single-class Pascal VOC subset. Like VOC's macro groups (animals share
fur, vehicles metal), the two classes of a macro group share their colours and textures and
differ only in shape; the groups differ in all three:

==========  =================  ===================================  ==========
class       shape              textures (either, per instance)      macro
==========  =================  ===================================  ==========
disc        disc               solid, concentric bands              round
ring        annulus            solid, concentric bands              round
square      square             horizontal stripes, checkerboard     boxy
diamond     rhombus (2:1)      horizontal stripes, checkerboard     boxy
triangle    triangle           dots, diagonal stripes               pointy
star        5 points           dots, diagonal stripes               pointy
cross       plus               vertical stripes, fine grain         linear
bar         ellipse            vertical stripes, fine grain         linear
==========  =================  ===================================  ==========

Each instance has a random size and rotation (the texture follows it); its pattern colour
is drawn near one of its macro group's two hues (``GROUP_HUES``; jitter +-0.03, random
saturation and value) and the texture's ground is the same colour darker. The background is
a smooth random colour field with a faint random sinusoidal grating, pixel noise and a few
distractor strokes of any colour, all labelled background; objects are drawn over them.
Like VOC, a one-pixel band on each object's outline is void (255) unless
``void_edges=False``. Everything is vectorised numpy and deterministic from the seed: 1,500
images of 48 x 48 take about a second on one core.

``version=1`` gives the first generator's images exactly (the sets ``shapes_v1`` and
``shapes_macro_v1``): one hue and one texture per class, the diamond a square turned 45
degrees, 1,200 training images. The current sets (version 2) have 2,400 training images, so
that 100 clients hold at least 10 each, and a separate pretraining set
(:func:`pretraining_set`, another generator seed) that shares no image with them.
"""

from __future__ import annotations

import numpy as np
import torch

from protofl.data.federated import FederatedData
from protofl.data.partition import capped
from protofl.data.segmentation import mask_federation
from protofl.errors import ProtoflError
from protofl.sizes import Need, check
from protofl.tasks import VOID

SHAPE_CLASSES = ("disc", "ring", "square", "diamond", "triangle", "star", "cross", "bar")
MACRO_NAMES = ("background", "round", "boxy", "pointy", "linear")
MACRO_OF = (1, 1, 2, 2, 3, 3, 4, 4)  # macro index of each object class in SHAPE_CLASSES order
SHAPES_SIZE = 48
SHAPES_TRAIN = {1: 1200, 2: 2400}  # training images of each version
SHAPES_TEST = 300
SHAPES_CLIENTS = 20
MAX_INSTANCES = 3
STROKES = 4
TRAIN_SEED, TEST_SEED = 1, 2  # the set is fixed; data.seed only changes the partition
PRETRAIN_SEED, PRETRAIN_SIZE = 3, 2400  # the pretraining set: another stream, no shared image
VERSIONS = (1, 2)
# version 2: the two hues of each macro group (round, boxy, pointy, linear), shared by its
# classes; group g's textures are _texture's 2g and 2g + 1
GROUP_HUES = ((0.0, 0.07), (0.25, 0.33), (0.5, 0.58), (0.75, 0.83))


def _shape(k: int, a: np.ndarray, b: np.ndarray, version: int = 2) -> np.ndarray:
    """Inside test of object class ``k`` in unit local coordinates (radius 1)."""
    r = np.hypot(a, b)
    if k == 0:
        return r <= 1.0
    if k == 1:
        return (r <= 1.0) & (r >= 0.55)
    if k == 2:
        return np.maximum(np.abs(a), np.abs(b)) <= 0.8
    if k == 3:  # version 1: a square turned 45 degrees; then a 2:1 rhombus
        return np.abs(a) + np.abs(b) <= 1.05 if version == 1 else (
            np.abs(a) / 1.2 + np.abs(b) / 0.6 <= 1.0)
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


def _background(rng: np.random.Generator, n: int, size: int, yy: np.ndarray, xx: np.ndarray
                ) -> np.ndarray:
    """Float images (n, 3, S, S): colour field, faint grating, noise, distractor strokes."""
    s = size / SHAPES_SIZE
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
    return img


def _looks(rng: np.random.Generator, labels: np.ndarray, version: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One instance per image: (pattern colour (n, 3), ground colour (n, 3), texture (n,)).
    Version 1: the class's own hue and texture; version 2: one of its macro group's."""
    n = len(labels)
    if version == 1:
        fg = _hue_colour(rng, (labels - 1) / len(SHAPE_CLASSES))
        return fg, fg * rng.uniform(0.3, 0.55, (n, 1)), labels - 1
    group = (labels - 1) // 2
    pick = rng.integers(0, 2, (2, n))  # which of the group's hues, which of its textures
    fg = _hue_colour(rng, np.asarray(GROUP_HUES)[group, pick[0]])
    return fg, fg * rng.uniform(0.3, 0.55, (n, 1)), 2 * group + pick[1]


def _paint(img: np.ndarray, mask: np.ndarray, rng: np.random.Generator, labels: np.ndarray,
           yy: np.ndarray, xx: np.ndarray, version: int) -> None:
    """1..3 instances of each image's class, painted in order over ``img`` and ``mask``."""
    n, size = len(labels), img.shape[-1]
    s = size / SHAPES_SIZE  # sizes below are in pixels of a 48 x 48 image
    count = rng.integers(1, MAX_INSTANCES + 1, n)
    for j in range(MAX_INSTANCES):
        radius = rng.uniform(12, 18, n) * s / count ** 0.4  # several instances: smaller
        cx, cy = (rng.uniform(0.2, 0.8, (2, n)) * size)
        angle = rng.uniform(0, 2 * np.pi, n)
        fg, bg, texture = _looks(rng, labels, version)
        for k, t in sorted(set(zip((labels - 1).tolist(), texture.tolist()))):
            idx = np.flatnonzero((labels == k + 1) & (texture == t) & (count > j))
            if not len(idx):
                continue
            c, si = np.cos(angle[idx])[:, None, None], np.sin(angle[idx])[:, None, None]
            dx, dy = xx - cx[idx, None, None], yy - cy[idx, None, None]
            u, v = c * dx + si * dy, -si * dx + c * dy
            r = radius[idx, None, None]
            inside = _shape(k, u / r, v / r, version)
            pattern = _texture(t, u / s, v / s)
            colour = np.where(pattern[:, None], fg[idx, :, None, None],
                              bg[idx, :, None, None]).astype(np.float32)
            sub = img[idx]
            np.copyto(sub, colour, where=inside[:, None])
            img[idx] = sub
            mask[idx] = np.where(inside, k + 1, mask[idx])


def generate_shapes(n: int, size: int = SHAPES_SIZE, seed: int = 0, void_edges: bool = True,
                    version: int = 2) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` images: ``(images uint8 (n, 3, S, S), masks uint8 (n, S, S), labels int64 (n,))``.

    Mask values are 0 (background), 1..8 (the object class, ``SHAPE_CLASSES`` order) and 255
    (void outline); ``labels`` is each image's object class (1..8). ``version`` 1 is the
    first generator (see the module docstring).
    """
    if size < 16:
        raise ProtoflError(f"shapes image size must be >= 16 pixels, got {size}")
    if version not in VERSIONS:
        raise ProtoflError(f"shapes generator version {version!r}; allowed: 1, 2")
    rng = np.random.default_rng(seed)
    yy, xx = np.meshgrid(np.arange(size, dtype=np.float32), np.arange(size, dtype=np.float32),
                         indexing="ij")
    labels = rng.integers(1, len(SHAPE_CLASSES) + 1, n)
    img = _background(rng, n, size, yy, xx)
    mask = np.zeros((n, size, size), dtype=np.uint8)
    _paint(img, mask, rng, labels, yy, xx, version)
    if void_edges:
        obj = mask > 0
        pad = np.pad(obj, ((0, 0), (1, 1), (1, 1)), mode="edge")
        edge = obj & ~(pad[:, :-2, 1:-1] & pad[:, 2:, 1:-1] & pad[:, 1:-1, :-2]
                       & pad[:, 1:-1, 2:])
        mask[edge] = VOID
    images = np.clip(np.rint(img * 255), 0, 255).astype(np.uint8)
    return images, mask, labels.astype(np.int64)


def pretraining_set(n: int = PRETRAIN_SIZE, size: int = SHAPES_SIZE
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pretraining images (version 2, seed ``PRETRAIN_SEED``): the same classes and
    look as ``shapes``, none of its training or test images."""
    return generate_shapes(n, size, seed=PRETRAIN_SEED)


def macro_lut() -> np.ndarray:
    """A 256-entry table mapping shapes mask values to macro values (void stays 255)."""
    lut = np.full(256, VOID, dtype=np.uint8)
    lut[0] = 0
    lut[1:len(SHAPE_CLASSES) + 1] = MACRO_OF
    return lut


def _shapes(cfg, macro: bool, version: int = 2) -> FederatedData:
    size = cfg.image_size or SHAPES_SIZE
    n = SHAPES_TRAIN[version]
    check([Need("data.image_size", size, (n + SHAPES_TEST) * 4 * size * size
                + n * 3 * size * size * 4,  # uint8 images and masks; float32 while painted
                f"{n + SHAPES_TEST} generated {size} x {size} images and their masks")])
    x, y, lab = generate_shapes(n, size, seed=TRAIN_SEED, version=version)
    x_test, y_test, lab_test = generate_shapes(SHAPES_TEST, size, seed=TEST_SEED,
                                               version=version)
    keep = capped(n, cfg)
    x, y, lab = x[keep], y[keep], lab[keep]
    name = ("shapes_macro" if macro else "shapes") + ("_v1" if version == 1 else "")
    return mask_federation(name,
                           MACRO_NAMES if macro else ("background",) + SHAPE_CLASSES,
                           (x, y, lab), (x_test, y_test, lab_test), cfg, SHAPES_CLIENTS,
                           macro_lut() if macro else None)


def shapes_federation(cfg) -> FederatedData:
    """Shapes, 9 classes (background + 8 objects); Dirichlet(alpha) power-law clients."""
    return _shapes(cfg, macro=False)


def shapes_macro_federation(cfg) -> FederatedData:
    """Shapes with its 5 macro classes (background, round, boxy, pointy, linear)."""
    return _shapes(cfg, macro=True)


def shapes_v1_federation(cfg) -> FederatedData:
    """The first generator's Shapes (one hue and texture per class), 9 classes."""
    return _shapes(cfg, macro=False, version=1)


def shapes_macro_v1_federation(cfg) -> FederatedData:
    """The first generator's Shapes with its 5 macro classes."""
    return _shapes(cfg, macro=True, version=1)
