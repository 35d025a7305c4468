"""The comparison rule of ``protofl suite reproduce`` and the reproduction tables it feeds.

The rule (fixed before any run; docs/reproduction.md): a claim "method beats baseline" is
read from paired runs, the same run seed and partition (``data.seed``) for both, over at
least ``MIN_SEEDS`` seeds. Each pair gives two differences, method − baseline, of

(a) the **last rounds**: the mean of the metric over the last ``TAIL`` (10%, at least one)
    of the evaluated rounds, and
(b) the **curve's area**: the mean of the metric over every evaluated round.

For each reading the mean difference and its 95% t-interval (Student's t, n − 1 degrees of
freedom) are taken. Verdict: **reproduced** when the interval lies above 0 on both readings;
**not reproduced** when it lies at or below 0 on both; **inconclusive** otherwise (the
intervals straddle 0, disagree, or fewer than ``MIN_SEEDS`` pairs exist).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from protofl.engine import runfolder
from protofl.errors import ProtoflError

MIN_SEEDS = 5
TAIL = 0.10
LEVEL = 0.95
READINGS = ("last", "area")


def readings(rows: list[dict], metric: str, tail: float = TAIL) -> dict[str, float]:
    """``{last: mean of the last ceil(tail · n) evaluated values, area: mean of all}``."""
    values = [float(r[metric]) for r in rows if isinstance(r.get(metric), (int, float))]
    if not values:
        raise ProtoflError(f"no evaluated round logs {metric!r}")
    k = max(1, math.ceil(tail * len(values)))
    return {"last": float(np.mean(values[-k:])), "area": float(np.mean(values))}


def t_interval(diffs: list[float], level: float = LEVEL) -> dict[str, Any]:
    """Mean of ``diffs`` and its two-sided ``level`` t-interval (NaN bounds when n < 2)."""
    from scipy import stats

    d = np.asarray(diffs, dtype=float)
    n = len(d)
    mean = float(d.mean()) if n else math.nan
    if n < 2:
        return {"mean": mean, "lo": math.nan, "hi": math.nan, "n": n}
    half = float(stats.t.ppf(0.5 + level / 2, n - 1) * d.std(ddof=1) / math.sqrt(n))
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": n}


def side(iv: dict[str, Any]) -> str:
    """``above`` (lo > 0), ``below`` (hi <= 0) or ``straddles`` (or undefined)."""
    if iv["lo"] > 0:
        return "above"
    if iv["hi"] <= 0:
        return "below"
    return "straddles"


def verdict(intervals: dict[str, dict[str, Any]], min_seeds: int = MIN_SEEDS) -> str:
    """The rule's verdict from the intervals of both readings (claimed direction: > 0)."""
    if min(iv["n"] for iv in intervals.values()) < min_seeds:
        return "inconclusive"
    sides = {side(iv) for iv in intervals.values()}
    if sides == {"above"}:
        return "reproduced"
    if sides == {"below"}:
        return "not reproduced"
    return "inconclusive"


def _runs(folder: Path, metric: str) -> dict[tuple[int, int], dict[str, float]]:
    """``(seed, data.seed) -> readings`` of every finished run ``folder/seed*``."""
    out = {}
    for run in sorted(folder.glob("seed*")):
        if not (run / runfolder.SUMMARY).exists():
            continue
        cfg = runfolder.load_config_json(run)
        key = (int(cfg.get("seed", 0)), int(cfg.get("data", {}).get("seed", 0)))
        out[key] = readings(runfolder.read_metrics(run), metric)
    return out


def paired(split_dir: Path, method: str, baseline: str, metric: str) -> dict[str, Any]:
    """The paired comparison of two variants of one split: per-reading intervals of the
    difference, the variants' mean readings, and the verdict."""
    a, b = _runs(split_dir / method, metric), _runs(split_dir / baseline, metric)
    keys = sorted(a.keys() & b.keys())
    ivs = {r: t_interval([a[k][r] - b[k][r] for k in keys]) for r in READINGS}
    means = {name: {r: float(np.mean([runs[k][r] for k in keys])) if keys else math.nan
                    for r in READINGS} for name, runs in (("method", a), ("baseline", b))}
    return {"intervals": ivs, "means": means, "n": len(keys), "verdict": verdict(ivs)}


def load_record(folder: Path) -> dict[str, dict]:
    """``{claim: {budget, status, seeds}}`` from a reproduce folder's record."""
    import json

    from protofl.reproduce import PLAN_FILE

    path = Path(folder) / PLAN_FILE
    try:
        record = json.loads(path.read_text())["claims"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ProtoflError(f"{folder} is not a `protofl suite reproduce` folder (no readable "
                           f"{PLAN_FILE})") from None
    return {name: {**entry, "folder": Path(folder)} for name, entry in record.items()}


def merged_records(folders: list[Path]) -> dict[str, dict]:
    """Per claim, the record of the largest budget that ran (else the last one given)."""
    best: dict[str, dict] = {}
    for folder in folders:
        for name, entry in load_record(folder).items():
            old = best.get(name)
            ran, old_ran = entry["status"] == "run", old and old["status"] == "run"
            if (old is None or (ran and not old_ran)
                    or (ran and old_ran and entry["budget"] == "paper")):
                best[name] = entry
    return best


def _num(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:+.3f}"


def result_text(res: dict[str, Any]) -> str:
    """``last: +0.012 [-0.004, +0.028]; area: ...`` with the means compared."""
    parts = []
    for r, word in (("last", "last 10%"), ("area", "area")):
        iv = res["intervals"][r]
        m, b = res["means"]["method"][r], res["means"]["baseline"][r]
        parts.append(f"{word}: {_num(iv['mean'])} [{_num(iv['lo'])}, {_num(iv['hi'])}] "
                     f"({m:.3f} vs {b:.3f})")
    return "; ".join(parts) + f"; n = {res['n']}"


def change_text(claim, entry: dict, res: dict[str, Any] | None) -> str:
    """What would change the verdict (or let the claim run at all)."""
    if entry["status"] != "run":
        return entry["status"].split(": ", 1)[-1]
    notes = []
    if entry["budget"] != "paper":
        notes.append(f"the short budget is a smoke test: `{claim.command('paper')}`")
    if res is not None and res["verdict"] == "inconclusive" and res["n"] >= MIN_SEEDS:
        notes.append("more seeds (`--seeds`) to narrow the interval")
    if res is not None and res["n"] < MIN_SEEDS:
        notes.append(f"at least {MIN_SEEDS} seeds")
    if claim.stand_in:
        notes.append(f"a stand-in for {claim.stand_in}")
    return "; ".join(notes) or "another protocol or reconstruction choice (see below)"


SEED_TITLES = {"first": "First seed: Michieli & Ozay, prototype-guided FL (fedmargin)",
               "second": "Second seed: Kumar, Garg & Sundaresan, FedProIn (fedproin)"}
HEADER = ["| claim | protocol | budget run here | comparison (what differs) | result: "
          "method − baseline, mean [95% t-interval] (method vs baseline) | verdict | what "
          "would change it |", "|---|---|---|---|---|---|---|"]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def claim_rows(claim, entry: dict | None) -> list[str]:
    """The table rows of one claim: one per (split, comparison) when it ran, else one."""
    protocol = "; ".join(claim.sources)
    if entry is None:
        entry = {"status": f"not run yet (run `{claim.command('paper')}`)", "budget": "-"}
    head = f"**{claim.name}**: {claim.statement} ({claim.metric})"
    if entry["status"] != "run":
        first = claim.comparisons[0]
        state, change = entry["status"].split(":", 1)[0], change_text(claim, entry, None)
        return [f"| {_cell(head)} | {_cell(protocol)} | none | {first.method} − "
                f"{first.baseline} ({first.differs}) and {len(claim.comparisons) - 1} more | "
                f"– | {state} | {_cell(change)} |"]
    rows = []
    seeds = entry.get("seeds", [])
    budget = f"{entry['budget']}, seeds {', '.join(map(str, seeds))}"
    for split in claim.splits:
        for c in claim.comparisons:
            res = paired(entry["folder"] / claim.name / split, c.method, c.baseline,
                         claim.metric)
            where = "" if split == "default" else f"{split}: "
            lead = ["", "", ""] if rows else [_cell(head), _cell(protocol), budget]
            rows.append(f"| {' | '.join(lead)} | {where}{c.method} − {c.baseline} "
                        f"({c.differs}) | {result_text(res)} | **{res['verdict']}** | "
                        f"{_cell(change_text(claim, entry, res))} |")
    return rows


def reproduction_markdown(folders: list[Path], only: list[str] | None = None) -> str:
    """One table per seed over every claim (``only``: just these), from the reproduce
    folders given (per claim the largest budget that ran)."""
    from protofl.reproduce import CLAIMS

    records = merged_records([Path(f) for f in folders])
    lines = []
    for doc, title in SEED_TITLES.items():
        claims = [c for c in CLAIMS.values() if c.seed_doc == doc
                  and (only is None or c.name in only)]
        if not claims:
            continue
        lines += [f"### {title}", "", *HEADER]
        for claim in claims:
            lines += claim_rows(claim, records.get(claim.name))
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def write_reproduction(folders: list[Path], md: Path, overwrite: bool = False) -> Path:
    """Write (or update the generated section of) ``md`` with the claim tables."""
    from protofl.report import outputs
    from protofl.report.markdown import begin, end, merge_sections

    md = Path(md)
    if md.exists() and not overwrite:
        raise ProtoflError(f"{md} exists; pass --overwrite to update its generated section")
    outputs.writable(md)
    name = "reproduction"
    block = "\n".join([begin(name), "", reproduction_markdown(folders), "", end(name)])
    old = md.read_text() if md.exists() else "# Reproduction\n"
    outputs.write_text(md, merge_sections(old, {name: block}))
    return md
