"""The claims at a glance: every paired comparison's mean difference and 95% interval at
the paper budget, on both readings, one row each (a forest plot), coloured by its verdict
(orange: fragile, a decided verdict whose deciding bound lies within the cross-machine
drift)."""

from __future__ import annotations

import math
from pathlib import Path

from protofl.report.canvas import subplots
from protofl.report.claims import fragile
from protofl.reproduce.claims import CLAIMS
from protofl.reproduce.tables import results

COLOURS = {"reproduced": "tab:green", "not reproduced": "tab:red",
           "inconclusive": "tab:gray", "fragile": "tab:orange"}


def forest(records: dict[str, dict], path: Path) -> Path | None:
    """Draw the comparisons of every claim that ran at the paper budget with at least 2
    pairs into ``path`` (PNG); None (nothing written) when there is none."""
    rows = [(f"{name}{'' if split == 'default' else ' ' + split}: {c.method} − {c.baseline}"
             f" (n = {res['n']})", res)
            for name, claim in CLAIMS.items()
            if (entry := records.get(name)) is not None and entry["status"] == "run"
            and entry["budget"] == "paper"  # the short budget is a smoke test
            for split, c, res in results(claim, entry) if res["n"] >= 2]
    if not rows:
        return None
    fig, axes = subplots(1, 2, figsize=(12, 0.8 + 0.28 * len(rows)), sharey=True,
                         layout="constrained")
    ys = list(range(len(rows)))[::-1]
    for ax, (reading, title) in zip(axes, (("last", "last 10% of rounds"),
                                           ("area", "area (mean over rounds)"))):
        for y, (_, res) in zip(ys, rows):
            iv = res["intervals"][reading]
            colour = COLOURS["fragile" if fragile(res) else res["verdict"]]
            ax.plot([iv["lo"], iv["hi"]], [y, y], color=colour, lw=2)
            ax.plot([iv["mean"]], [y], "o", color=colour, ms=4)
        ax.axvline(0, color="black", lw=0.8)
        ax.set_title(f"method − baseline, {title}", fontsize=9)
        ax.tick_params(labelsize=7)
        finite = [v for _, r in rows for k in ("lo", "hi")
                  if math.isfinite(v := r["intervals"][reading][k])]
        if finite:  # one seed's huge interval must not flatten the others
            lo, hi = min(finite), max(finite)
            ax.set_xlim(max(lo, -1.0) - 0.02, min(hi, 1.0) + 0.02)
    axes[0].set_yticks(ys, [label for label, _ in rows], fontsize=7)
    for verdict, colour in COLOURS.items():
        axes[1].plot([], [], color=colour, lw=2, label=verdict)
    axes[1].legend(fontsize=7, loc="lower right")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
