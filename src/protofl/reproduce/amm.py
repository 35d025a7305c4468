"""The first seed's AMM-accuracy correlation (ρ = 0.68, p = 0.01, over its Tables 2 and 4)
from the claims' runs: the final round's aggregate mean margin against the final metric."""

from __future__ import annotations

import math

import numpy as np

from protofl.report.claims import verdict
from protofl.reproduce.claims import CLAIMS


def amm_points(entry: dict) -> list[tuple[str, str, float, float]]:
    """``(split, variant, final AMM, final metric)`` of every run in a claim's evidence that
    logged the AMM."""
    return [(split, v, amm[key][-1], entry["runs"][split][v][key][-1])
            for split, variants in entry.get("amm", {}).items()
            for v, amm in variants.items() for key in sorted(amm)
            if key in entry["runs"].get(split, {}).get(v, {})]


def correlation(x: list[float], y: list[float]) -> dict[str, float]:
    """Pearson's ρ, its two-sided p-value and 95% interval (Fisher's z); NaN below 4 points
    or for a constant series."""
    from scipy import stats

    if len(x) < 4 or len(set(x)) < 2 or len(set(y)) < 2:
        return {"rho": math.nan, "p": math.nan, "lo": math.nan, "hi": math.nan, "n": len(x)}
    res = stats.pearsonr(x, y)
    ci = res.confidence_interval(0.95)
    return {"rho": float(res.statistic), "p": float(res.pvalue), "lo": float(ci.low),
            "hi": float(ci.high), "n": len(x)}


AMM_HEADER = ["| claim | points | Pearson ρ, final AMM vs final metric [95% interval] | p | "
              "verdict |", "|---|---|---|---|---|"]


def amm_rows(records: dict[str, dict]) -> list[str]:
    """The first seed's AMM-accuracy correlation (ρ = 0.68 over its Tables 2 and 4): per
    claim and split over its runs (splits are not pooled: their metric levels differ, which
    would correlate the splits rather than the runs), and over the variants' means of every
    paper-budget claim and split (its Tables' cells); the claims' verdict rule on rho's
    interval (above 0, at least 5 points)."""
    rows, cells = [], []
    for claim in CLAIMS.values():
        entry = records.get(claim.name)
        if claim.seed_doc != "first" or entry is None or entry["status"] != "run":
            continue
        points = amm_points(entry)
        for split in dict.fromkeys(p[0] for p in points):
            mine = [p for p in points if p[0] == split]
            name = claim.name if len(claim.splits) == 1 else f"{claim.name} {split}"
            rows.append((f"{name} ({entry['budget']}; every run)",
                         correlation([p[2] for p in mine], [p[3] for p in mine])))
            if entry["budget"] == "paper":
                for v in dict.fromkeys(p[1] for p in mine):
                    cell = [p for p in mine if p[1] == v]
                    cells.append((float(np.mean([p[2] for p in cell])),
                                  float(np.mean([p[3] for p in cell]))))
    if cells:
        rows.append(("every paper-budget claim and split (one point a claim, split and "
                     "variant: the variants' means)",
                     correlation([c[0] for c in cells], [c[1] for c in cells])))
    out = []
    for label, r in rows:
        word = verdict({"rho": r})  # the claims' rule, on the interval of rho
        rho = ("– (fewer than 4 points, or a constant series)" if math.isnan(r["rho"]) else
               f"{r['rho']:+.2f} [{r['lo']:+.2f}, {r['hi']:+.2f}]")
        p = "–" if math.isnan(r["p"]) else f"{r['p']:.2g}"
        out.append(f"| {label} | {r['n']} | {rho} | {p} | **{word}** |")
    return out
