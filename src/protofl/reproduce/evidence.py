"""The evidence behind docs/reproduction.md: per claim, the evaluated curve of every finished
run (the claim's metric, and the AMM where it is logged), in one JSON file a claim
(``docs/reproduction/<claim>.json``).

Run folders are large and live outside the repository; the evidence files are small and are
committed beside the tables, so the tables can be regenerated, checked and extended with
more seeds without the run folders: ``protofl report`` reads reproduce folders and evidence
folders alike and merges them (see ``merge``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from protofl.errors import ProtoflError
from protofl.report.claims import logged
from protofl.reproduce.claims import ALTERNATIVES_DIR, CLAIMS, PLAN_FILE
from protofl.reproduce.search import search_curves

FORMAT = "protofl-reproduce-evidence/1"
# an entry: {budget, status, seeds, splits, overrides (the suite's --set, --rounds, --device),
# runs: {split: {variant: Curves}}, amm: the same, alternatives: the same}
# ("runs": the claim's metric; "amm": the aggregate mean margin, where a run logs it;
# "alternatives": the claim's metric of the reconstruction's alternatives and the references
# run beside them (``suite reproduce --alternatives``), written only where some ran;
# "search": the validation accuracy of a claim's learning-rate search runs, by variant@lr)
CURVES = ("runs", "amm", "alternatives", "search")
OPTIONAL = ("alternatives", "search")
Entry = dict[str, Any]


def from_folder(folder: Path) -> dict[str, Entry]:
    """Every claim of a ``protofl suite reproduce`` folder, its finished runs' curves read."""
    path = Path(folder) / PLAN_FILE
    try:
        record = json.loads(path.read_text())["claims"]
        if not isinstance(record, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise ProtoflError(f"{folder} is not a `protofl suite reproduce` folder (no readable "
                           f"{PLAN_FILE}) nor a folder of evidence files") from None
    out = {}
    for name, entry in record.items():
        claim = CLAIMS.get(name)
        if claim is None:  # a claim this version no longer has
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("status"), str):
            raise ProtoflError(f"{path}: the record of claim {name!r} is malformed; remove it")
        read: dict[str, dict] = {key: {} for key in CURVES}
        if entry["status"] == "run":
            for split in entry.get("splits") or claim.splits:
                for v in claim.variants:
                    found = logged(Path(folder) / name / split / v, claim.metric, "amm")
                    for key, metric in (("runs", claim.metric), ("amm", "amm")):
                        if found[metric]:
                            read[key].setdefault(split, {})[v] = found[metric]
                for v in claim.alternative_variants():
                    found = logged(Path(folder) / name / split / ALTERNATIVES_DIR / v,
                                   claim.metric)
                    if found[claim.metric]:
                        read["alternatives"].setdefault(split, {})[v] = found[claim.metric]
            read["search"] = search_curves(claim, Path(folder), entry.get("splits")
                                           or list(claim.splits))
        out[name] = {"overrides": {}, **entry, **read}
    return out


# the order of an evidence file's keys, whatever order its sources held them in, so that
# writing it again from the same runs gives the same bytes
ORDER = ("overrides", "budget", "status", "seeds", "splits", *CURVES)


def _first(keys, known: list[str]) -> list[str]:
    """``keys`` in the order of ``known``, then the rest sorted."""
    keys = list(keys)
    return [k for k in known if k in keys] + sorted(k for k in keys if k not in known)


def _sorted(value: Any) -> Any:
    """Dicts (at any depth) with their keys sorted: ``--set`` overrides given in another
    order are the same overrides."""
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value, key=str)}
    return value


def _encode(name: str, entry: Entry) -> dict[str, Any]:
    """The evidence file of one claim, in a canonical order: the keys in ``ORDER``
    (others sorted after), the overrides sorted, splits and variants in the claim's order
    (others sorted after), runs by (seed, data.seed)."""
    claim = CLAIMS.get(name)
    splits = list(claim.splits) if claim else []
    search = claim.search if claim else None
    order = {"alternatives": list(claim.alternative_variants()) if claim else [],
             "search": [search.label(v, lr) for v in claim.variants for lr in search.grid]
             if search else [],
             **{key: list(claim.variants) if claim else [] for key in ("runs", "amm")}}
    doc: dict[str, Any] = {"format": FORMAT, "claim": name}
    for key in _first(entry, list(ORDER)):
        value = entry[key]
        if key in OPTIONAL and not value:
            continue
        if key in CURVES:
            value = {split: {v: [{"seed": s, "data_seed": d, "values": vals}
                                 for (s, d), vals in sorted(value[split][v].items())]
                             for v in _first(value[split], order[key])}
                     for split in _first(value, splits)}
        elif key == "overrides":
            value = _sorted(value or {})
        elif key == "splits":
            value = _first(value, splits)
        doc[key] = value
    for key in CURVES:
        if key not in OPTIONAL:
            doc.setdefault(key, {})
    return doc


def _decode(doc: dict[str, Any], path: Path) -> Entry:
    try:
        read = {key: {split: {v: {(int(r["seed"]), int(r["data_seed"])):
                                  [float(x) for x in r["values"]] for r in rows}
                              for v, rows in variants.items()}
                      for split, variants in doc.get(key, {}).items()} for key in CURVES}
        return {"budget": str(doc["budget"]), "status": str(doc["status"]),
                "seeds": [int(s) for s in doc["seeds"]], "splits": list(doc["splits"]),
                "overrides": dict(doc.get("overrides") or {}), **read}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ProtoflError(f"{path} is not a protofl evidence file (a field is missing or "
                           "malformed)") from None


def write(entries: dict[str, Entry], folder: Path) -> list[Path]:
    """One evidence file a claim under ``folder`` (``<claim>.json``, replaced)."""
    from protofl.report import outputs

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, entry in entries.items():
        path = folder / f"{name}.json"
        doc = _encode(name, entry)
        outputs.write_text(path, json.dumps(doc, indent=None, separators=(",", ":")) + "\n")
        paths.append(path)
    return paths


def load(source: Path) -> dict[str, Entry]:
    """The claims of a reproduce folder, an evidence file or a folder of evidence files."""
    source = Path(source)
    if source.is_dir() and not (source / PLAN_FILE).exists():
        files = sorted(source.glob("*.json"))
        if files:
            return {k: v for f in files for k, v in load(f).items()}
    if source.is_file():
        try:
            doc = json.loads(source.read_text())
        except (OSError, ValueError):
            raise ProtoflError(f"{source} is not a protofl evidence file (not JSON)") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ProtoflError(f"{source} is not a protofl evidence file (format {FORMAT})")
        if doc.get("claim") not in CLAIMS:
            return {}  # a claim this version no longer has
        return {doc["claim"]: _decode(doc, source)}
    return from_folder(source)


def _union(old: Entry, new: Entry, splits: list[str]) -> Entry:
    """Two entries of one claim at one budget: their runs together (``new`` wins a run both
    hold), their seeds together, their splits together in the order of ``splits``."""
    both = {}
    for key in CURVES:
        both[key] = {split: {v: dict(c) for v, c in variants.items()}
                     for split, variants in old.get(key, {}).items()}
        for split, variants in new.get(key, {}).items():
            for v, c in variants.items():
                both[key].setdefault(split, {}).setdefault(v, {}).update(c)
    return {**new, "seeds": sorted({*old["seeds"], *new["seeds"]}),
            "splits": _first({*old["splits"], *new["splits"]}, splits), **both}


def merge(sources: list[Path]) -> dict[str, Entry]:
    """Per claim, the runs of the largest budget that ran (``paper`` over ``short``), the
    sources of that budget and the same overrides taken together (a later source wins a run
    both hold, and replaces runs made with other overrides); a claim that ran nowhere keeps
    the last record given (why it did not run)."""
    best: dict[str, Entry] = {}
    for source in sources:
        for name, entry in load(source).items():
            entry.setdefault("splits", list(CLAIMS[name].splits))
            old = best.get(name)
            ran, old_ran = entry["status"] == "run", old is not None and old["status"] == "run"
            if (old_ran and ran and entry["budget"] == old["budget"]
                    and entry["overrides"] == old["overrides"]):
                best[name] = _union(old, entry, list(CLAIMS[name].splits))
            elif old is None or (ran and not old_ran) or (ran and entry["budget"] == "paper"):
                best[name] = entry
    return best


def kept_entry(folder: Path, name: str, budget: str,
               overrides: dict[str, Any] | None) -> Entry | None:
    """Claim ``name``'s entry in the evidence in ``folder`` if it ran at ``budget`` with
    these overrides (None otherwise)."""
    entry = merge([Path(folder)]).get(name)
    if (entry is None or entry["status"] != "run" or entry["budget"] != budget
            or _sorted(entry["overrides"]) != _sorted(overrides or {})):
        return None
    return entry


def kept_runs(folder: Path, name: str, budget: str, overrides: dict[str, Any] | None,
              alternatives: bool = False) -> frozenset[tuple[str, str, int, int]]:
    """The runs of claim ``name`` that the evidence in ``folder`` holds at ``budget`` with
    these overrides, as ``(split, variant, seed, data.seed)`` (``alternatives``: its
    alternatives' runs), so that a suite resumed across machines runs only the rest."""
    entry = kept_entry(folder, name, budget, overrides)
    if entry is None:
        return frozenset()
    key = "alternatives" if alternatives else "runs"
    return frozenset((split, v, s, d) for split, variants in entry.get(key, {}).items()
                     for v, curves in variants.items() for s, d in curves)
