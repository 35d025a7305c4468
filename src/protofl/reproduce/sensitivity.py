"""How much a claim's verdict depends on fedmargin's reconstructed choices: each alternative
(``claims.ALTERNATIVES``, run by ``protofl suite reproduce --alternatives``) paired, by the
rule of ``protofl.report.claims``, with the default fedmargin and the FedAvg run beside it,
from the evidence's ``alternatives`` curves; and how far those references moved from the
claim's own runs of the same configs (the runs' drift between machines or sessions)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from protofl.report.claims import (
    DRIFT,
    READING_WORDS,
    Curves,
    fragile,
    interval_text,
    paired,
    placement,
    readings,
    verdict_text,
)
from protofl.reproduce.claims import ALTERNATIVES, CLAIMS, REFERENCES, Claim
from protofl.reproduce.tables import results

HEADER = ["| claim | alternative | alternative − default fedmargin (mean [95% t-interval], "
          "where it lies) | against FedAvg: the rule's verdict, alternative − FedAvg |",
          "|---|---|---|---|"]


def placed_text(res: dict[str, Any]) -> str:
    """Both readings of a paired result, each with where its interval lies against 0."""
    return "; ".join(f"{word} {interval_text(res['intervals'][r])}, "
                     f"{placement(res['intervals'][r])}" for r, word in READING_WORDS.items())


def _against(res: dict[str, Any]) -> str:
    if not res["n"]:
        return "– (no FedAvg has finished beside it yet)"
    return f"{verdict_text(res)}: {placed_text(res)}; n = {res['n']}"


def alternative_results(claim: Claim, entry: dict
                        ) -> Iterator[tuple[str, str, dict[str, Any], dict[str, Any], bool]]:
    """``(split, alternative, − default fedmargin, − FedAvg, identical)`` of every
    alternative that ran (``identical``: its curves are the default's, seed for seed)."""
    for split, runs in entry.get("alternatives", {}).items():
        default, fedavg = (runs.get(label, {}) for label in REFERENCES)
        for alt in claim.alternatives:
            mine: Curves = runs.get(alt, {})
            if not mine:
                continue
            same = all(default.get(k) == v for k, v in mine.items())
            yield split, alt, paired(mine, default), paired(mine, fedavg), same


def sensitivity_rows(claim: Claim, entry: dict) -> list[str]:
    """The table rows of one claim: the reference row, then one per alternative that ran."""
    rows = []
    for split, runs in entry.get("alternatives", {}).items():
        where = "" if split == "default" else f" ({split})"
        ref = paired(runs.get("fedmargin", {}), runs.get("fedavg", {}))
        if ref["n"]:
            rows.append(f"| **{claim.name}**{where} | the default fedmargin (run beside the "
                        f"alternatives) | – | {_against(ref)} |")
    for split, alt, to_default, to_fedavg, same in alternative_results(claim, entry):
        key, value = alt.split("=", 1)
        name = f"`{key}: {value}` ({ALTERNATIVES[alt][1]})"
        change = ("the default's curves on every seed (identical runs)" if same
                  else f"{placed_text(to_default)}; n = {to_default['n']}")
        rows.append(f"| {claim.name}{'' if split == 'default' else f' ({split})'} | {name} | "
                    f"{change} | {_against(to_fedavg)} |")
    return rows


def drift(records: dict[str, dict]) -> dict[str, Any]:
    """The references run beside the alternatives against the claim's own runs of the same
    variant, seed and partition: ``{curves, identical, round, reading}`` (the pairs
    compared, those equal bit for bit, the largest per-round and per-reading difference)."""
    out = {"curves": 0, "identical": 0, "round": 0.0, "reading": 0.0}
    for entry in records.values():
        for split, runs in entry.get("alternatives", {}).items():
            for label in REFERENCES:
                theirs = entry.get("runs", {}).get(split, {}).get(label, {})
                for key, values in runs.get(label, {}).items():
                    if key not in theirs or len(theirs[key]) != len(values):
                        continue
                    other = theirs[key]
                    out["curves"] += 1
                    out["identical"] += values == other
                    out["round"] = max(out["round"], *(abs(a - b) for a, b in
                                                       zip(values, other)))
                    ra, rb = readings(values), readings(other)
                    out["reading"] = max(out["reading"], *(abs(ra[r] - rb[r]) for r in ra))
    return out


def drift_text(records: dict[str, dict]) -> str:
    """The references' drift from the claim's runs, in one sentence ('' when none)."""
    d = drift(records)
    if not d["curves"]:
        return ""
    return (f"The references run beside the alternatives repeat the claim's own runs of the "
            f"same config, seed and partition on {d['identical']} of {d['curves']} curves bit "
            f"for bit; the others differ by up to {d['round']:.4f} in a round and "
            f"{d['reading']:.4f} in a reading (last 10% or area), which is why each "
            "alternative is paired with the references run beside it, not with the claim's "
            "runs.")


def within_drift(records: dict[str, dict], drift: float) -> list[str]:
    """The decided comparisons of every claim whose deciding bound lies within ``drift``
    of 0 (``report.claims.fragile``), as ``claim (split): method - baseline``."""
    return [f"{name}{'' if split == 'default' else f' ({split})'}: {c.method} − {c.baseline}"
            for name, claim in CLAIMS.items() if name in records
            for split, c, res in results(claim, records[name])
            if res is not None and fragile(res, drift)]


def drift_check_text(records: dict[str, dict]) -> str:
    """What the drift measured beside the alternatives would make fragile, were it the
    rule's (it is not: the rule's was fixed before the runs); '' without a measurement."""
    d = drift(records)
    if not d["curves"] or d["reading"] <= DRIFT:
        return ""
    hit = within_drift(records, d["reading"])
    return (f"Were the rule's drift the {d['reading']:.4f} measured here, not ±{DRIFT}, the "
            f"comparisons whose deciding bound would lie within it: "
            f"{'; '.join(hit) if hit else 'none'}.")


def sensitivity_markdown(records: dict[str, dict]) -> str:
    """The sensitivity table over every claim whose evidence holds alternatives."""
    rows = [row for name, claim in CLAIMS.items() if name in records
            for row in sensitivity_rows(claim, records[name])]
    if not rows:
        return "No alternative has run (`protofl suite reproduce --alternatives`)."
    text = " ".join(t for t in (drift_text(records), drift_check_text(records)) if t)
    return "\n".join([*HEADER, *rows, *(["", text] if text else [])])
