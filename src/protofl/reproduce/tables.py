"""The claim tables of docs/reproduction.md from `protofl suite reproduce` folders and
evidence files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from protofl.report.claims import (
    DELTA,
    DRIFT,
    MIN_SEEDS,
    claim_verdict,
    fragile,
    paired,
    result_text,
    verdict_text,
)
from protofl.reproduce import evidence
from protofl.reproduce.amm import AMM_HEADER, amm_rows
from protofl.reproduce.claims import CLAIMS, Claim, Comparison
from protofl.reproduce.plan import rerun_command
from protofl.reproduce.prereg import planned, planned_text


def compare(claim: Claim, split: str, c: Comparison, runs: dict) -> dict[str, Any]:
    """The paired result of one comparison by the rule, with the equivalence margin of the
    claim's metric and, where it is pre-registered, only its pre-registered seeds."""
    plan = planned(claim.name, split, c.method, c.baseline)
    return paired(runs.get(c.method, {}), runs.get(c.baseline, {}), DELTA[claim.metric],
                  plan["seeds"] if plan else None)


def change_text(claim: Claim, entry: dict, res: dict[str, Any] | None, first: bool = True) -> str:
    """What would change the verdict (or let the claim run at all)."""
    if entry["status"] != "run":
        return entry["status"].split(": ", 1)[-1]
    notes = []
    if entry["budget"] != "paper" and claim.cost:
        notes.append(f"the short budget is a smoke test; the paper budget (`"
                     f"{claim.command('paper')}`) was too costly here: {claim.cost}")
    elif entry["budget"] != "paper":
        notes.append(f"the short budget is a smoke test: `{claim.command('paper')}`")
    if res is not None and res.get("pending") is not None:
        notes.append(f"the pre-registered {res['planned']} seeds ({res['pending']} ran: "
                     f"`{claim.command(entry['budget'])} --seeds "
                     f"{','.join(map(str, range(res['planned'])))} --kept docs/reproduction`); "
                     "no verdict before all have")
    elif res is not None and res["verdict"] == "inconclusive" and res["n"] >= MIN_SEEDS:
        notes.append("more seeds (`--seeds`) to narrow the interval")
    if res is not None and "intervals" in res and fragile(res):
        notes.append(f"more seeds (`--seeds`) to move its bound clear of the drift (±{DRIFT}); "
                     "until then a rerun on another machine could turn it")
    if res is not None and res["n"] < MIN_SEEDS:
        why = f" (here: {claim.cost})" if first and claim.cost and entry["budget"] == "paper" \
            else ""
        notes.append(f"at least {MIN_SEEDS} seeds{why}")
    missing = [k for k in claim.splits if k not in (entry.get("splits") or claim.splits)]
    if missing and first:
        notes.append(f"the splits not run here: {', '.join(missing)} (`"
                     f"{claim.command(entry['budget'])} --splits {','.join(missing)}`)")
    if claim.stand_in and first:
        notes.append(f"a stand-in for {claim.stand_in}: the seed's data")
    return "; ".join(notes) or "another protocol or reconstruction choice (see below)"


SEED_TITLES = {"first": "First seed: Michieli & Ozay, prototype-guided FL (fedmargin)",
               "second": "Second seed: Kumar, Garg & Sundaresan, FedProIn (fedproin)"}
HEADER = ["| claim | protocol | budget run here: seeds, the command that reruns it | "
          "comparison (what differs) | result: method − baseline, mean [95% t-interval] "
          "(method vs baseline) | verdict (the rule above) | what would change it |",
          "|---|---|---|---|---|---|---|"]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def deciding_text(claim: Claim, with_plan: bool = True) -> str:
    """The comparisons that form the claim's verdict, in words (``with_plan``: and their
    pre-registration, where they have one)."""
    pairs = [c for c in claim.comparisons if c.decides]
    methods = list(dict.fromkeys(c.method for c in pairs))
    text = "; ".join(f"{m} − {', '.join(c.baseline for c in pairs if c.method == m)}"
                     for m in methods)
    if len(pairs) > 1:
        text += " (each)"
    if list(claim.splits) != ["default"]:
        text += f", on {', '.join(claim.splits)}"
    plans = [planned(claim.name, split, c.method, c.baseline)
             for split in claim.splits for c in pairs]
    if with_plan and plans and all(plans):
        text += "; " + planned_text(plans)
    return text


def claim_result(claim: Claim, entry: dict | None) -> dict[str, Any] | None:
    """The claim's verdict by the claim rule (``claim_verdict``) over its deciding
    comparisons on every split it names (one not run counts as not run); None when the
    claim did not run."""
    if entry is None or entry["status"] != "run":
        return None
    ran = entry.get("splits") or claim.splits
    deciding: list[dict[str, Any] | None] = []
    for split in claim.splits:
        runs = entry["runs"].get(split, {}) if split in ran else None
        for c in claim.comparisons:
            if c.decides:
                res = None if runs is None else compare(claim, split, c, runs)
                deciding.append(res if res and res["n"] else None)
    return claim_verdict(deciding)


CLAIM_HEADER = ["| claim | budget run here | the claim's verdict (the claim rule) | "
                "decided by (the other comparisons explain it) |", "|---|---|---|---|"]


def claim_summary_row(claim: Claim, entry: dict | None) -> str:
    cv = claim_result(claim, entry)
    if cv is None:
        state = entry["status"].split(":", 1)[0] if entry else "not run yet"
        budget, word = "none", state
    else:
        budget = entry["budget"]
        word = (f"**fragile** ({cv['verdict']} by the claim rule, resting on a fragile "
                "comparison)" if cv["fragile"] else f"**{cv['verdict']}**")
        if entry["budget"] != "paper":
            word += " (a smoke test, never evidence)"
    return f"| **{claim.name}** | {budget} | {word} | {_cell(deciding_text(claim))} |"


def results(claim: Claim, entry: dict) -> Iterator[tuple[str, Comparison, dict[str, Any]]]:
    """``(split, comparison, paired result)`` of every comparison of a claim that ran."""
    for split in entry.get("splits") or claim.splits:
        runs = entry["runs"].get(split, {})
        for c in claim.comparisons:
            yield split, c, compare(claim, split, c, runs)


def claim_rows(claim: Claim, entry: dict | None) -> list[str]:
    """The table rows of one claim: one per (split, comparison) when it ran, else one."""
    protocol = "; ".join(claim.sources)
    if entry is None and claim.cost:
        entry = {"status": f"not run here: too costly here, {claim.cost} (run "
                           f"`{claim.command('paper')}`)", "budget": "-"}
    elif entry is None:
        entry = {"status": f"not run yet: run `{claim.command('paper')}`", "budget": "-"}
    head = f"**{claim.name}**: {claim.statement} ({claim.metric})"
    if entry["status"] != "run":
        first = claim.comparisons[0]
        state, change = entry["status"].split(":", 1)[0], change_text(claim, entry, None)
        return [f"| {_cell(head)} | {_cell(protocol)} | none | {first.method} − "
                f"{first.baseline} ({first.differs}) and {len(claim.comparisons) - 1} more | "
                f"– | {state} | {_cell(change)} |"]
    rows = []
    seeds = sorted({s for variants in entry["runs"].values() for c in variants.values()
                    for s, _ in c})
    budget = (f"{entry['budget']}, seeds {', '.join(map(str, seeds)) or 'none finished'}: "
              f"`{rerun_command(claim, entry)}`")
    for split, c, res in results(claim, entry):
        where = "" if split == "default" else f"{split}: "
        lead = ["", "", ""] if rows else [_cell(head), _cell(protocol), budget]
        if res["n"]:
            result, word = result_text(res), verdict_text(res)
            change = change_text(claim, entry, res, first=not rows)
        else:  # the suite was stopped before these variants ran
            result, word = "no paired runs yet", "not run yet"
            change = f"run `{claim.command(entry['budget'])}` to the end"
        role = "; decides the claim" if c.decides else ""
        rows.append(f"| {' | '.join(lead)} | {where}{c.method} − {c.baseline} "
                    f"({c.differs}{role}) | {result} | {_cell(word)} | {_cell(change)} |")
    return rows


def reproduction_markdown(sources: list[Path], only: list[str] | None = None) -> str:
    """One table per seed over every claim (``only``: just these), from the reproduce
    folders and evidence files given (``evidence.merge``)."""
    return tables_markdown(evidence.merge([Path(f) for f in sources]), only)


def tables_markdown(records: dict[str, dict], only: list[str] | None = None) -> str:
    """One table per seed over every claim (``only``: just these) of merged records, and the
    first seed's AMM-accuracy correlation over them."""
    lines = []
    for doc, title in SEED_TITLES.items():
        claims = [c for c in CLAIMS.values() if c.seed_doc == doc
                  and (only is None or c.name in only)]
        if not claims:
            continue
        lines += [f"### {title}", "", *CLAIM_HEADER,
                  *(claim_summary_row(c, records.get(c.name)) for c in claims), "", *HEADER]
        for claim in claims:
            lines += claim_rows(claim, records.get(claim.name))
        lines.append("")
        rows = amm_rows({c.name: records[c.name] for c in claims if c.name in records})
        if doc == "first" and rows:
            lines += ["#### AMM and accuracy (the seed: ρ = 0.68, p = 0.01, over its Tables 2 "
                      "and 4)", "", *AMM_HEADER, *rows, ""]
    return "\n".join(lines).rstrip("\n")
