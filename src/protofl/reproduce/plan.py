"""Planning and running the claims: budgets, data present or not, the jobs, the record."""

from __future__ import annotations

import json
from collections.abc import Iterable
from itertools import product
from pathlib import Path
from typing import Any

from protofl.config import merge
from protofl.errors import ProtoflError
from protofl.nested import flatten
from protofl.reproduce.claims import ALTERNATIVES_DIR, CLAIMS, NO_COSTLY, PLAN_FILE, Claim
from protofl.reproduce.evidence import kept_entry, kept_runs
from protofl.reproduce.search import chosen_rates, search_curves, search_jobs
from protofl.suites import seeded

BUDGETS = ("short", "paper")
SEEDS = {"short": (0, 1), "paper": (0, 1, 2, 3, 4)}


def select(names: str | None) -> list[Claim]:
    """The claims named (comma-separated; None or ``all``: every one)."""
    if not names or names == "all":
        return list(CLAIMS.values())
    picked = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in picked if n not in CLAIMS]
    if unknown or not picked:
        raise ProtoflError(f"--claims: unknown claim {(unknown or [names])[0]!r}; allowed: "
                           f"{', '.join(CLAIMS)}")
    return [CLAIMS[n] for n in dict.fromkeys(picked)]


def budget_config(claim: Claim, budget: str) -> dict[str, Any]:
    """The claim's base config at ``budget`` (before splits, variants and seeds)."""
    if budget not in BUDGETS:
        raise ProtoflError(f"--budget: {budget!r}; allowed: {', '.join(BUDGETS)}")
    return claim.protocol if budget == "paper" else merge(claim.protocol, claim.short)


def status(claim: Claim, budget: str, overrides: dict[str, Any] | None = None) -> str:
    """``run``, or why the claim is not run here (its data absent)."""
    if claim.needs:
        root = merge(claim.protocol, overrides or {}).get("data", {}).get("root")
        if not root or not Path(str(root)).expanduser().exists():
            return (f"not run here: needs {claim.needs} (run `{claim.command(budget)}`)")
    return "run"


def encoder_path(claim: Claim, budget: str, out: Path) -> Path:
    """Where the encoder a claim pretrains before its runs is kept (``OUT/encoders``)."""
    return (out / "encoders" / f"{claim.name}-{budget}.pth").resolve()


def pick(claim: Claim, option: str, names: tuple[str, ...] | None,
         known: Iterable[str]) -> list[str] | None:
    """The names a ``--splits`` or ``--variants`` option picks of a claim's ``known`` ones
    (None: every one); a name it lacks is one error line."""
    if not names:
        return None
    known = list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ProtoflError(f"--{option}: claim {claim.name} has no {option[:-1]} "
                           f"{unknown[0]!r}; it has {', '.join(known)}")
    return list(dict.fromkeys(names))


def claim_jobs(claim: Claim, budget: str, out: Path, seeds: tuple[int, ...],
               overrides: dict[str, Any] | None = None,
               splits: list[str] | None = None,
               alternatives: bool = False,
               kept: frozenset[tuple] = frozenset(),
               only: list[str] | None = None,
               rates: dict[str, dict[str, float]] | None = None) -> list[tuple[dict, str]]:
    """Every (raw config, run folder) of one claim at ``budget`` (``splits``, ``only``: just
    these splits, variants), two variants at a time over every seed (the first comparison's
    first), so that a suite stopped early leaves whole pairs of seeds for the headline
    comparison; ``alternatives``: instead, the reconstruction's alternatives and their
    references (``Claim.alternative_variants``), under ``ALTERNATIVES_DIR``; none of the
    runs in ``kept`` (``(split, variant, seed, data.seed)``, from ``evidence.kept``);
    ``rates``: per split and variant the learning rate its search chose."""
    base = budget_config(claim, budget)
    if claim.pretrain:
        base = merge(base, {"model": {"pretrained": str(encoder_path(claim, budget, out))}})
    variants = claim.alternative_variants() if alternatives else claim.variants
    first = (claim.comparisons[0].method, claim.comparisons[0].baseline)
    order = [v for v in [*first, *(v for v in variants if v not in first)]
             if only is None or v in only]
    jobs = []
    for k in range(0, len(order), 2):
        for seed, split, label in product(seeds, splits or claim.splits, order[k:k + 2]):
            raw = merge(merge(base, claim.splits[split]), variants[label])
            if rates is not None:
                raw = merge(raw, {"clients": {"optimizer": claim.search.optimizer,
                                              "lr": rates[split][label]}})
            raw = seeded(merge(raw, NO_COSTLY), seed, overrides)
            if (split, label, seed, raw["data"]["seed"]) in kept:
                continue
            where = out / claim.name / split
            where = where / ALTERNATIVES_DIR if alternatives else where
            jobs.append((raw, str(where / label / f"seed{seed}")))
    return jobs


def _held(job: tuple[dict, str], found: dict[str, dict]) -> bool:
    """A search job (``OUT/<claim>/<split>/search/<label>/seed<N>``) whose run ``found``
    (its search curves) already holds."""
    raw, folder = job
    parts = Path(folder).parts
    return (raw["seed"], raw["data"]["seed"]) in found.get(parts[-4], {}).get(parts[-2], {})


def reproduce_plan(names: str | None, budget: str, out: Path,
                   seeds: tuple[int, ...] | None = None,
                   overrides: dict[str, Any] | None = None,
                   splits: tuple[str, ...] | None = None,
                   alternatives: bool = False, kept: Path | None = None,
                   variants: tuple[str, ...] | None = None
                   ) -> tuple[dict[str, dict], list[tuple[dict, str]]]:
    """``({claim: {budget, status, seeds, splits}}, jobs)`` for the claims named
    (``splits``: only these of each claim; ``variants``: only these variants' runs, the
    record unchanged, since the evidence says per variant what ran; ``alternatives``: the
    reconstruction's alternatives instead of the claim's variants, on the claims that have
    them; ``kept``: an evidence folder whose runs of the same budget and overrides are not
    run again). A claim with a learning-rate search (``Claim.search``) plans its search
    runs, and its own runs only once the search has finished (its record says
    ``search: pending`` until then)."""
    seeds = tuple(seeds or SEEDS.get(budget, SEEDS["paper"]))
    claims = select(names)
    if alternatives:
        if names in (None, "all"):
            claims = [c for c in claims if c.alternatives]
        lacking = [c.name for c in claims if not c.alternatives]
        if lacking:
            raise ProtoflError(f"--alternatives: claim {lacking[0]} has no alternatives; these "
                               "do: " + ", ".join(c.name for c in CLAIMS.values()
                                                  if c.alternatives))
    record, jobs = {}, []
    for claim in claims:
        state = status(claim, budget, overrides)
        chosen = pick(claim, "splits", splits, claim.splits) or list(claim.splits)
        only = pick(claim, "variants", variants,
                    claim.alternative_variants() if alternatives else claim.variants)
        record[claim.name] = {"budget": budget, "status": state, "seeds": list(seeds),
                              "splits": chosen, "overrides": overrides or {}}
        if state != "run":
            continue
        done = (kept_runs(kept, claim.name, budget, overrides, alternatives)
                if kept is not None else frozenset())
        rates = None
        if claim.search and not alternatives:
            found = search_curves(claim, out, chosen)
            old = kept_entry(kept, claim.name, budget, overrides) if kept else None
            for split, labels in (old or {}).get("search", {}).items():
                for label, curves in labels.items():
                    found.setdefault(split, {}).setdefault(label, {}).update(curves)
            jobs += [job for job in search_jobs(claim, budget_config(claim, budget), out,
                                                chosen, overrides)
                     if not _held(job, found)]
            rates = chosen_rates(claim, found, chosen)
            if rates is None:  # the claim's runs wait for the search (run_reproduce)
                record[claim.name]["search"] = "pending"
                continue
        jobs += claim_jobs(claim, budget, out, seeds, overrides, chosen, alternatives, done,
                           only, rates)
    return record, jobs


def rerun_command(claim: Claim, entry: dict[str, Any]) -> str:
    """The command that runs a record's claim again as it ran: its budget, its seeds and
    splits (where not the defaults) and its overrides."""
    parts = [claim.command(entry["budget"])]
    seeds = tuple(entry.get("seeds") or ())
    if seeds and seeds != SEEDS.get(entry["budget"]):
        parts.append("--seeds " + ",".join(map(str, seeds)))
    splits = list(entry.get("splits") or claim.splits)
    if splits != list(claim.splits):
        parts.append("--splits " + ",".join(splits))
    for key, value in flatten(entry.get("overrides") or {}).items():
        parts.append(f"--set {key}={value if isinstance(value, str) else json.dumps(value)}")
    return " ".join(parts)


def write_record(out: Path, record: dict[str, dict]) -> Path:
    """Merge ``record`` into ``OUT/reproduce.json`` (claims run another time are kept)."""
    path = out / PLAN_FILE
    old: dict = {}
    if path.exists():
        try:
            old = json.loads(path.read_text()).get("claims", {})
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            raise ProtoflError(f"{path} is not a reproduce record; remove it") from None
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"claims": {**old, **record}}, indent=1) + "\n")
    return path
