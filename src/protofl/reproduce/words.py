"""The claims in words, generated from the evidence: every number and verdict word of the
claim-by-claim section of docs/reproduction.md (so that the words cannot say more than the
tables): per claim its verdict by the claim rule, each comparison's readings and where their
intervals lie against 0, the headline pair's final rounds per seed and its curves' largest
step between two evaluations."""

from __future__ import annotations

import math
from typing import Any

from protofl.report.claims import TAIL, verdict_text
from protofl.reproduce.claims import CLAIMS, Claim
from protofl.reproduce.prereg import planned, planned_text
from protofl.reproduce.search import chosen_rates, rates_text
from protofl.reproduce.sensitivity import placed_text
from protofl.reproduce.tables import claim_result, deciding_text, results


def _seeds(keys) -> str:
    return ", ".join(map(str, sorted(keys)))


def comparison_sentence(split: str, c: Any, res: dict[str, Any]) -> str:
    """One comparison: its verdict, both readings placed against 0, the variants' means."""
    where = "" if split == "default" else f"{split}: "
    head = f"{where}{c.method} − {c.baseline} ({c.differs}{'; decides' if c.decides else ''})"
    if not res["n"]:
        return f"{head}: not run yet (no paired runs)"
    m, b = res["means"]["method"]["last"], res["means"]["baseline"]["last"]
    pending = ("" if res.get("pending") is None else
               f" of the {res['planned']} pre-registered (no verdict before all have run)")
    return (f"{head}: {verdict_text(res)}; {placed_text(res)}; the last 10% means: "
            f"{c.method} {m:.3f} vs {c.baseline} {b:.3f}; n = {res['n']}{pending}")


def headline_keys(claim: Claim, entry: dict, split: str) -> list[tuple[int, int]]:
    """The (seed, data.seed) runs of ``split`` on which both variants of the headline
    comparison ran."""
    head = claim.comparisons[0]
    runs = entry["runs"].get(split, {})
    return sorted(runs.get(head.method, {}).keys() & runs.get(head.baseline, {}).keys())


def finals_sentence(claim: Claim, entry: dict, split: str) -> str:
    """The headline pair's final evaluated round per seed and its largest step between two
    consecutive evaluations ('' when the pair has no common run)."""
    head = claim.comparisons[0]
    runs = entry["runs"].get(split, {})
    a, b = runs.get(head.method, {}), runs.get(head.baseline, {})
    keys = headline_keys(claim, entry, split)
    if not keys:
        return ""
    n = len(a[keys[0]])
    finals = ", ".join(f"{s}: {a[(s, d)][-1]:.3f} vs {b[(s, d)][-1]:.3f}" for s, d in keys)
    steps = []
    for label, c in ((head.method, a), (head.baseline, b)):
        step, seed = max((max((abs(y - x) for x, y in zip(v, v[1:])), default=0.0), s)
                         for (s, _), v in c.items() if (s, _) in keys)
        steps.append(f"{label} {step:.3f} (seed {seed})")
    where = "" if split == "default" else f"{split}, "
    return (f"{where}{head.method} vs {head.baseline}, the final evaluated round by seed: "
            f"{finals}; the largest step between two consecutive evaluations (of {n}): "
            f"{', '.join(steps)}")


def plan_lines(claim: Claim, entry: dict) -> list[str]:
    """The claim's pre-registration and, for a claim with a learning-rate search, the rates
    it chose (or that it has not finished)."""
    plans = [p for split in claim.splits for c in claim.comparisons
             if (p := planned(claim.name, split, c.method, c.baseline))]
    lines = [f"{deciding_text(claim, False)}: {planned_text(plans)}"
             ] if plans else []
    if claim.search:
        rates = chosen_rates(claim, entry.get("search", {}), list(claim.splits))
        lines.append("the learning rates its pre-registered search chose (by the best mean "
                     "last-10% validation accuracy): " + (rates_text(claim, rates) if rates
                                                          else "the search has not finished"))
    return lines


def claim_words(claim: Claim, entry: dict | None) -> list[str]:
    """The bullet (with its sub-bullets) of one claim; none when it did not run."""
    cv = claim_result(claim, entry)
    if cv is None or entry is None:
        return []
    seeds = _seeds({s for v in entry["runs"].values() for c in v.values() for s, _ in c})
    word = f"**{cv['verdict']}**" + (", **fragile**" if cv["fragile"] else "")
    if entry["budget"] != "paper":
        return [f"- **{claim.name}**: run here only at the short budget (seeds {seeds}): "
                f"{word} by the claim rule; a smoke test, never evidence."]
    if not any(c for v in entry["runs"].values() for c in v.values()):
        return [f"- **{claim.name}**: {word} by the claim rule; none of its variants' runs "
                "has finished."]
    ran = list(entry.get("splits") or claim.splits)
    missing = [k for k in claim.splits if k not in ran]
    keys = {k for v in entry["runs"].values() for c in v.values() for k in c}
    parts = len({d for _, d in keys})
    n = max((len(vals) for v in entry["runs"].values() for c in v.values()
             for vals in c.values()), default=0)
    unrun = (f"; the splits {', '.join(missing)} did not run, and without them it cannot be "
             "reproduced" if missing else "")
    own = ", one a seed" if parts == len({s for s, _ in keys}) else ""
    paired_seeds = _seeds({s for split in entry["runs"] for s, _ in
                           headline_keys(claim, entry, split)})
    pair = ("" if paired_seeds == seeds else
            f"; the headline pair on seeds {paired_seeds or 'none yet'}")
    lines = [f"- **{claim.name}**: {word} by the claim rule (decided by "
             f"{deciding_text(claim, False)}{unrun}). Runs at the paper budget on seeds {seeds} "
             f"({parts} partitions{own}{pair}); a run is evaluated {n} times, so its last "
             f"10% is the mean of the last {max(1, math.ceil(TAIL * n))} of {n} evaluations."]
    lines += [f"  - {line}." for line in plan_lines(claim, entry)]
    lines += [f"  - {comparison_sentence(split, c, res)}."
              for split, c, res in results(claim, entry)]
    for split in ran:
        text = finals_sentence(claim, entry, split)
        if text:
            lines.append(f"  - {text}.")
    return lines


def words_markdown(records: dict[str, dict]) -> str:
    """The generated claim-by-claim words over every claim that ran."""
    lines = [line for name, claim in CLAIMS.items() for line in
             claim_words(claim, records.get(name))]
    absent = [name for name in CLAIMS if claim_result(CLAIMS[name], records.get(name)) is None]
    if absent:
        lines.append(f"- Not run here (the tables say why and give the command): "
                     f"{', '.join(absent)}.")
    return "\n".join(lines)
