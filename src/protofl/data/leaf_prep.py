"""LEAF's JSON from the raw FEMNIST and CelebA sources (our own implementation of LEAF's
preprocessing, so ``data.root`` works without LEAF's scripts).

FEMNIST (NIST Special Database 19): ``by_class/<hex>/hsf_*/*.png`` gives each image's class
(its hex ASCII code), ``by_write/hsf_*/<writer>/<kind>/*.png`` its writer; the same image is in
both trees, matched by content hash. Each writer becomes a LEAF user; images are 128x128 and
become 28x28 greyscale (Lanczos), 784 values in [0, 1] (white = 1), labels 0-9 digits, 10-35
'A'-'Z', 36-61 'a'-'z', in ``all_data/all_data_<i>.json`` (100 writers a file).

CelebA: a user per celebrity with at least 5 images (``identity_CelebA.txt``), x = image file
names, y = the ``Smiling`` attribute as 0/1 (``list_attr_celeba.txt``), in
``all_data/all_data.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import string
from pathlib import Path

import numpy as np

from protofl.errors import ProtoflError

FEMNIST_ALPHABET = string.digits + string.ascii_uppercase + string.ascii_lowercase
WRITERS_PER_FILE = 100
CELEBA_MIN_IMAGES = 5
CELEBA_TARGET = "Smiling"


def femnist_label(hex_code: str) -> int:
    """LEAF's FEMNIST label of a SD19 class folder name (the character's hex ASCII code)."""
    try:
        return FEMNIST_ALPHABET.index(chr(int(hex_code, 16)))
    except ValueError:
        raise ProtoflError(f"SD19 class folder {hex_code!r} is not the hex code of a digit "
                           "or letter") from None


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _find(raw: Path, name: str) -> Path:
    for c in (raw / name, *raw.glob(f"*/{name}")):
        if c.is_dir():
            return c
    raise ProtoflError(f"FEMNIST: folder {name}/ not found in {raw}")


def class_by_hash(by_class: Path, progress: bool = False) -> dict[str, int]:
    """MD5 of each ``by_class/<hex>/hsf_*/*.png`` -> its label."""
    from tqdm import tqdm

    files = [(p, femnist_label(d.name)) for d in sorted(by_class.iterdir())
             if d.is_dir() and len(d.name) == 2
             for s in sorted(d.iterdir()) if s.is_dir() and s.name.startswith("hsf_")
             for p in sorted(s.glob("*.png"))]
    return {_md5(p): y for p, y in tqdm(files, desc="hash by_class", disable=not progress)}


def writer_images(by_write: Path) -> dict[str, list[Path]]:
    """Writer folder name -> its PNGs, from ``by_write/hsf_*/<writer>/<kind>/*.png``."""
    out: dict[str, list[Path]] = {}
    for part in sorted(d for d in by_write.iterdir() if d.is_dir()):
        for writer in sorted(d for d in part.iterdir() if d.is_dir()):
            files = sorted(p for k in writer.iterdir() if k.is_dir() for p in k.glob("*.png"))
            out.setdefault(writer.name, []).extend(files)
    return out


def femnist_pixels(path: Path) -> list[float]:
    """One SD19 image as LEAF stores it: 28x28 greyscale, row-major, values in [0, 1]."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            small = im.convert("L").resize((28, 28), Image.Resampling.LANCZOS)
    except (OSError, ValueError) as e:
        raise ProtoflError(f"FEMNIST image {path} cannot be read ({e})") from None
    return (np.asarray(small, dtype=np.float64).reshape(-1) / 255.0).tolist()


def femnist_to_leaf(by_class: Path, by_write: Path, out: Path, progress: bool = False) -> int:
    """Write LEAF JSON for every writer into ``out`` (``all_data_<i>.json``); returns the
    number of images written. Images of ``by_write`` missing from ``by_class`` are skipped."""
    from tqdm import tqdm

    labels = class_by_hash(by_class, progress)
    writers = writer_images(by_write)
    if not writers:
        raise ProtoflError(f"FEMNIST: no writer folder with PNG images in {by_write}")
    out.mkdir(parents=True, exist_ok=True)
    names = sorted(writers)
    written = 0
    with tqdm(total=sum(len(v) for v in writers.values()), desc="FEMNIST JSON",
              disable=not progress) as bar:
        for i in range(0, len(names), WRITERS_PER_FILE):
            doc: dict = {"users": [], "num_samples": [], "user_data": {}}
            for w in names[i:i + WRITERS_PER_FILE]:
                xs, ys = [], []
                for p in writers[w]:
                    y = labels.get(_md5(p))
                    if y is not None:
                        xs.append(femnist_pixels(p))
                        ys.append(y)
                    bar.update(1)
                if ys:
                    doc["users"].append(w)
                    doc["num_samples"].append(len(ys))
                    doc["user_data"][w] = {"x": xs, "y": ys}
                    written += len(ys)
            if doc["users"]:
                (out / f"all_data_{i // WRITERS_PER_FILE}.json").write_text(json.dumps(doc))
    if not written:
        raise ProtoflError(f"FEMNIST: no image of {by_write} was found in {by_class}")
    return written


def femnist_prepare(folder: Path, progress: bool = False) -> None:
    """Fetch step: ``folder/raw/{by_class,by_write}`` -> ``folder/all_data/``; the raw
    images (about 1.6 million PNGs) are removed afterwards."""
    raw = folder / "raw"
    femnist_to_leaf(_find(raw, "by_class"), _find(raw, "by_write"), folder / "all_data",
                    progress)
    shutil.rmtree(raw, ignore_errors=True)


def celeba_to_leaf(identities: Path, attributes: Path, target: str = CELEBA_TARGET,
                   min_images: int = CELEBA_MIN_IMAGES) -> dict:
    """LEAF's CelebA document: a user per celebrity with >= ``min_images`` images (in order
    of first appearance), x = image names, y = ``target`` as 0/1."""
    by_celeb: dict[str, list[str]] = {}
    for line in identities.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2:
            by_celeb.setdefault(parts[1], []).append(parts[0])
    lines = attributes.read_text().splitlines()
    if len(lines) < 2 or target not in lines[1].split():
        raise ProtoflError(f"CelebA attributes {attributes} lack the {target!r} column "
                           "(expected a count line, then the attribute names)")
    col = lines[1].split().index(target)
    value: dict[str, int] = {}
    for line in lines[2:]:
        parts = line.split()
        if len(parts) > col + 1:
            value[parts[0]] = int(int(parts[col + 1]) > 0)
    doc: dict = {"users": [], "num_samples": [], "user_data": {}}
    for celeb, images in by_celeb.items():
        images = [i for i in images if i in value]
        if len(images) >= min_images:
            doc["users"].append(celeb)
            doc["num_samples"].append(len(images))
            doc["user_data"][celeb] = {"x": images, "y": [value[i] for i in images]}
    if not doc["users"]:
        raise ProtoflError(f"CelebA: no celebrity in {identities} has {min_images} images "
                           f"with attributes in {attributes}")
    return doc


def celeba_prepare(folder: Path, progress: bool = False) -> None:
    """Fetch step for CelebA put by hand in ``folder/raw/``: writes
    ``folder/all_data/all_data.json`` (atomically: a temporary file, then a rename)."""
    raw = folder / "raw"
    need = [raw / "identity_CelebA.txt", raw / "list_attr_celeba.txt",
            raw / "img_align_celeba"]
    missing = [str(p) for p in need if not p.exists()]
    if missing:
        raise ProtoflError(f"missing {', '.join(missing)}")
    out = folder / "all_data"
    if (out / "all_data.json").is_file():
        return
    doc = celeba_to_leaf(need[0], need[1])
    out.mkdir(exist_ok=True)
    tmp = out / "all_data.json.tmp"
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, out / "all_data.json")
