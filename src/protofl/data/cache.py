"""A dataset's cache folder: the FederatedData it holds (``load_cached``: its arrays
memory-mapped), written by ``publish`` / ``persist`` and built once per machine by
``mapped``. The arrays' side (budget, folders, keys, allocation) is ``data/store.py``."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import numpy as np
import torch

from protofl.data.federated import FederatedData
from protofl.data.store import (
    LABELS,
    META,
    VERSION,
    Store,
    _map,
    cache_home,
    cache_key,
    mapped_file,
)
from protofl.errors import ProtoflError


def save_meta(store: Store, data) -> None:
    """Flush a build's memmaps and write labels, offsets and the container's small fields
    next to them; the meta file, written last, marks the cache complete."""
    folder = store.folder
    for arr in store.maps:
        arr.flush()
    per_image = {k: getattr(data, k).numpy() for k in ("labels_train", "labels_local_test",
                                                       "labels_test")
                 if getattr(data, k) is not None}  # segmentation: each image's object class
    np.savez(folder / LABELS, y_train=data.y_train.numpy(), y_local_test=data.y_local_test.numpy(),
             y_test=data.y_test.numpy(), train_offsets=data.train_offsets,
             test_offsets=data.test_offsets, **per_image)
    arrays = {k: {"shape": list(getattr(data, k).shape),
                  "dtype": str(getattr(data, k).numpy().dtype)}
              for k in ("x_train", "x_local_test", "x_test")}
    meta = {"version": VERSION, "name": data.name, "num_classes": data.num_classes,
            "class_names": data.class_names, "scale": data.scale, "mean": data.mean,
            "std": data.std, "arrays": arrays,
            "test_is_local": data.x_test is data.x_local_test}
    tmp = folder / (META + ".tmp")
    tmp.write_text(json.dumps(meta))
    tmp.replace(folder / META)


def building_folder(folder: Path) -> Path:
    """A private folder to build ``folder``'s cache in (``publish`` renames it into place),
    so processes that load the same dataset at once never write the same files."""
    return folder.with_name(f"{folder.name}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def publish(store: Store, data, folder: Path):
    """Complete the cache built in ``store.folder`` and move it to ``folder``; if another process
    got there first, drop ours and map theirs. Returns the data to use."""
    save_meta(store, data)
    try:
        store.folder.rename(folder)
    except OSError:  # the final folder exists: another process published it
        shutil.rmtree(store.folder, ignore_errors=True)  # our mappings stay valid until dropped
        return load_cached(folder) or data
    return data


def load_cached(folder: Path) -> FederatedData | None:
    """The FederatedData a complete cache folder holds (arrays memory-mapped), or None."""
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if meta.get("version") != VERSION:
        return None
    try:
        with np.load(folder / LABELS) as z:
            labels = {k: z[k] for k in z.files}
    except (OSError, ValueError) as e:
        raise ProtoflError(f"dataset cache {folder} is damaged ({e}); delete the folder") from None
    a = meta["arrays"]
    x = {k: _map(folder, k, a[k]["shape"], a[k]["dtype"]) for k in a
         if not (k == "x_test" and meta["test_is_local"])}
    if meta["test_is_local"]:
        x["x_test"] = x["x_local_test"]
    return FederatedData(
        name=meta["name"], num_classes=meta["num_classes"], x_train=x["x_train"],
        y_train=torch.from_numpy(labels["y_train"]), train_offsets=labels["train_offsets"],
        x_local_test=x["x_local_test"], y_local_test=torch.from_numpy(labels["y_local_test"]),
        test_offsets=labels["test_offsets"], x_test=x["x_test"],
        y_test=torch.from_numpy(labels["y_test"]), class_names=meta["class_names"],
        scale=meta["scale"], mean=_floats(meta.get("mean")), std=_floats(meta.get("std")),
        **{k: torch.from_numpy(labels[k]) for k in ("labels_train", "labels_local_test",
                                                    "labels_test") if k in labels})


ARRAYS = ("x_train", "x_local_test", "x_test")


def persist(data, folder: Path):
    """Write an in-memory FederatedData to the cache folder ``folder`` (built privately and
    renamed into place, as ``publish``) and return it mapped from there."""
    part = building_folder(folder)
    part.mkdir(parents=True)
    for name in ARRAYS:
        if not (name == "x_test" and data.x_test is data.x_local_test):
            np.save(part / f"{name}.npy", getattr(data, name).numpy())
    publish(Store(part, 0), data, folder)
    return load_cached(folder) or data


def mapped(kind: str, key: dict, root: str | Path | None, build):
    """The FederatedData ``build()`` returns, built once per machine: kept under
    ``kind-<hash of key, the protofl version and root's files>`` in the cache and mapped from
    there by later calls (other processes included); data already mapped are returned as
    they are."""
    from protofl.provenance import version

    folder = cache_home() / f"{kind}-{cache_key({'protofl': version('protofl'), **key}, root)}"
    data = load_cached(folder)
    if data is not None:
        return data
    data = build()
    if mapped_file(data.x_train) is not None:  # (a large dataset: the loader mapped it)
        return data
    return persist(data, folder)


def _floats(v: list | None) -> tuple[float, ...] | None:
    return None if v is None else tuple(float(a) for a in v)
