"""A suite: a named grid of runs (datasets x runs x seeds) and what it draws at the end; the
suites themselves are ``suites.py`` and ``suites_hetero.py``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Suite:
    description: str
    datasets: dict[str, dict[str, Any]]
    runs: dict[str, dict[str, Any]]
    seeds: tuple[int, ...] = (0, 1, 2)
    extra: list[str] = field(default_factory=list)
    ffd: bool = False  # a central reference per dataset and seed; FFD logged by every run
    # run label -> the dataset labels it runs on (default: every one)
    runs_on: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # what the suite draws at the end besides the table: (out, every (raw, folder)) -> files
    finish: Callable[[Path, list[tuple[dict, str]]], list[Path]] | None = None
