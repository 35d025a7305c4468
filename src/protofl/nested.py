"""Nested dicts (of tensors or config values) flattened to dotted keys."""

from __future__ import annotations

from typing import Any


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (leaves are anything that is not a dict)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`flatten` for trees two levels deep whose top-level keys hold no dot
    (uploads, contributions): ``{"params.body.0.weight": t}`` -> ``{"params": {"body.0.weight":
    t}}``; the second-level keys keep their dots."""
    out: dict[str, Any] = {}
    for key, v in flat.items():
        top, dot, rest = key.partition(".")
        if dot:
            out.setdefault(top, {})[rest] = v
        else:
            out[key] = v
    return out
