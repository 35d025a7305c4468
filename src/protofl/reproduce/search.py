"""A claim's learning-rate search (``claims.Search``): its runs, their validation curves, and
the rate it chooses for every variant and split, before the claim's own runs."""

from __future__ import annotations

from itertools import product
from pathlib import Path
from typing import Any

import numpy as np

from protofl.config import merge
from protofl.report.claims import Curves, logged, readings
from protofl.reproduce.claims import NO_COSTLY, SEARCH_DIR, Claim
from protofl.suites import seeded

METRIC = "validation_accuracy"
Rates = dict[str, dict[str, float]]  # split -> variant -> learning rate


def search_jobs(claim: Claim, base: dict[str, Any], out: Path, splits: list[str],
                overrides: dict[str, Any] | None = None) -> list[tuple[dict, str]]:
    """Every (raw config, run folder) of the search: each variant at each rate of the grid,
    on every split and search seed, with the validation rows held out."""
    s = claim.search
    assert s is not None
    jobs = []
    for split, label, lr, seed in product(splits, claim.variants, s.grid, s.seeds):
        raw = merge(merge(base, claim.splits[split]), claim.variants[label])
        raw = merge(raw, {"clients": {"optimizer": s.optimizer, "lr": lr},
                          "data": {"validation_fraction": s.validation_fraction}})
        raw = seeded(merge(raw, NO_COSTLY), seed, overrides)
        folder = out / claim.name / split / SEARCH_DIR / s.label(label, lr) / f"seed{seed}"
        jobs.append((raw, str(folder)))
    return jobs


def search_curves(claim: Claim, folder: Path, splits: list[str]) -> dict[str, dict[str, Curves]]:
    """``{split: {variant@lr: Curves}}`` of the search's finished runs under ``folder`` (a
    reproduce folder)."""
    s = claim.search
    out: dict[str, dict[str, Curves]] = {}
    if s is None:
        return out
    for split, label, lr in product(splits, claim.variants, s.grid):
        runs = logged(folder / claim.name / split / SEARCH_DIR / s.label(label, lr),
                      METRIC)[METRIC]
        if runs:
            out.setdefault(split, {})[s.label(label, lr)] = runs
    return out


def chosen_rates(claim: Claim, curves: dict[str, dict[str, Curves]],
                 splits: list[str]) -> Rates | None:
    """Per split and variant the grid's rate of the best mean last-10% validation accuracy
    over the search seeds (a tie: the smaller rate); None until every search run finished."""
    s = claim.search
    assert s is not None
    rates: Rates = {}
    for split, label in product(splits, claim.variants):
        scores = []
        for lr in sorted(s.grid):
            runs = curves.get(split, {}).get(s.label(label, lr), {})
            if {seed for seed, _ in runs} != set(s.seeds):
                return None
            scores.append((float(np.mean([readings(v)["last"] for v in runs.values()])), lr))
        best = max(score for score, _ in scores)
        rates.setdefault(split, {})[label] = next(lr for score, lr in scores if score == best)
    return rates


def rates_text(claim: Claim, rates: Rates) -> str:
    """``iid: fedproin 0.001, fedavg 0.003, ...; dir0.5: ...``."""
    return "; ".join(f"{split}: " + ", ".join(f"{v} {lr:g}" for v, lr in chosen.items())
                     for split, chosen in rates.items())
