"""A suite: a named grid of runs (datasets x runs x seeds) and what it draws at the end; the
suites themselves are ``suites.py`` and ``suites_hetero.py``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Runs = dict[str, dict[str, Any]]


@dataclass
class Suite:
    description: str
    datasets: dict[str, dict[str, Any]]
    # run label -> overrides; or a function giving them when the suite is planned (a grid
    # derived from the algorithm registry, so that methods registered later join it)
    runs: Runs | Callable[[], Runs]
    seeds: tuple[int, ...] = (0, 1, 2)
    extra: list[str] = field(default_factory=list)
    ffd: bool = False  # a central reference per dataset and seed; FFD logged by every run
    # run label -> the dataset labels it runs on (default: every one)
    runs_on: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # what the suite draws at the end besides the table: (out, every (raw, folder)) -> files
    finish: Callable[[Path, list[tuple[dict, str]]], list[Path]] | None = None
    # dataset label -> the data it needs under its data.root, said when absent (the dataset
    # is then not run: "not run here: needs ..."); datasets not named here are embedded
    needs: dict[str, str] = field(default_factory=dict)

    def run_table(self) -> Runs:
        """The runs, as planned now."""
        return self.runs() if callable(self.runs) else self.runs
