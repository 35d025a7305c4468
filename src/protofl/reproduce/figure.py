"""The claims at a glance: every paired comparison's mean difference and 95% interval at
the paper budget, on both readings, one row each (a forest plot). Claims are separated by a
line; within a claim the deciding comparisons come first, drawn thick with bold labels, the
isolating ones below them, thin. Each reading is coloured by its own interval: above 0,
below 0, or across it."""

from __future__ import annotations

import math
from pathlib import Path

from protofl.report.canvas import subplots
from protofl.reproduce.claims import CLAIMS
from protofl.reproduce.tables import results

COLOURS = {"interval above 0": "tab:green", "interval below 0": "tab:red",
           "interval across 0": "tab:gray"}


def reading_colour(interval: dict) -> str:
    """The colour of one reading's interval: where it lies against 0."""
    if interval["lo"] > 0:
        return COLOURS["interval above 0"]
    if interval["hi"] < 0:
        return COLOURS["interval below 0"]
    return COLOURS["interval across 0"]


def _rows(records: dict[str, dict]) -> list[list[tuple[str, bool, dict]]]:
    """Per claim that ran at the paper budget, its rows (label, deciding, result): the
    deciding comparisons first."""
    groups = []
    for name, claim in CLAIMS.items():
        entry = records.get(name)
        if entry is None or entry["status"] != "run" or entry["budget"] != "paper":
            continue  # the short budget is a smoke test
        rows = [(f"{name}{'' if split == 'default' else ' ' + split}: {c.method} − "
                 f"{c.baseline} (n = {res['n']})", c.decides, res)
                for split, c, res in results(claim, entry) if res["n"] >= 2]
        if rows:
            groups.append(sorted(rows, key=lambda row: not row[1]))
    return groups


def forest(records: dict[str, dict], path: Path) -> Path | None:
    """Draw the comparisons of every claim that ran at the paper budget with at least 2
    pairs into ``path`` (PNG); None (nothing written) when there is none."""
    groups = _rows(records)
    if not groups:
        return None
    rows = [row for group in groups for row in group]
    fig, axes = subplots(1, 2, figsize=(12, 0.8 + 0.28 * len(rows)), sharey=True,
                         layout="constrained")
    ys = list(range(len(rows)))[::-1]
    bounds = [ys[0] + 0.5]  # the lines between claims
    for group in groups:
        bounds.append(bounds[-1] - len(group))
    for ax, (reading, title) in zip(axes, (("last", "last 10% of rounds"),
                                           ("area", "area (mean over rounds)"))):
        for y, (_, decides, res) in zip(ys, rows):
            iv = res["intervals"][reading]
            colour = reading_colour(iv)
            ax.plot([iv["lo"], iv["hi"]], [y, y], color=colour, lw=3 if decides else 1.2)
            ax.plot([iv["mean"]], [y], "o", color=colour, ms=5 if decides else 3)
        for b in bounds[1:-1]:
            ax.axhline(b, color="0.6", lw=0.6, ls=":")
        ax.axvline(0, color="black", lw=0.8)
        ax.set_title(f"method − baseline, {title}", fontsize=9)
        ax.tick_params(labelsize=7)
        finite = [v for _, _, r in rows for k in ("lo", "hi")
                  if math.isfinite(v := r["intervals"][reading][k])]
        if finite:  # one seed's huge interval must not flatten the others
            lo, hi = min(finite), max(finite)
            ax.set_xlim(max(lo, -1.0) - 0.02, min(hi, 1.0) + 0.02)
    axes[0].set_yticks(ys, [label for label, _, _ in rows], fontsize=7)
    for tick, (_, decides, _) in zip(axes[0].get_yticklabels(), rows):
        tick.set_fontweight("bold" if decides else "normal")
    for label, colour in COLOURS.items():
        axes[1].plot([], [], color=colour, lw=2, label=label)
    axes[1].plot([], [], color="black", lw=3, label="deciding comparison (bold)")
    axes[1].plot([], [], color="black", lw=1.2, label="isolating comparison")
    axes[1].legend(fontsize=7, loc="lower right")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
