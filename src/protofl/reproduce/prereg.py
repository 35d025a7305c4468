"""Pre-registered sample sizes: per open claim, from its 5-pair pilot, the number of seeds
whose paired comparison's 90% interval has a half-width of at most δ
(``report.claims.DELTA``) with probability ``POWER``; written once, before the runs, to
``preregistration.PREREGISTERED`` (claim, split, comparison, δ, n, seeds, date, commit).
A verdict of a pre-registered comparison reads its first n seeds and only once all ran
(``report.claims.paired``'s ``seeds``): no stopping when the numbers look good."""

from __future__ import annotations

from typing import Any

import numpy as np

from protofl.report.claims import DELTA, EQUIVALENCE_LEVEL, MIN_SEEDS, READINGS, readings
from protofl.reproduce.claims import CLAIMS

POWER = 0.80
PILOT_SEEDS = (0, 1, 2, 3, 4)
# claim -> (the claim whose runs are its pilot, the n fixed in advance or None: computed)
PLANS: dict[str, tuple[str, int | None]] = {
    "synthetic-main": ("synthetic-main", None),
    "synthetic": ("synthetic", None),
    # the issue fixes 5 seeds; the n a half-width of δ would need is recorded beside it
    "fedproin-digits-fair": ("fedproin-digits", 5),
}


def planned_n(sd: float, delta: float, power: float = POWER,
              level: float = EQUIVALENCE_LEVEL, least: int = MIN_SEEDS) -> int:
    """The smallest n >= ``least`` with P(t · S / √n <= delta) >= ``power``, S the sample
    sd of n paired differences of true sd ``sd`` ((n − 1) S² / sd² ~ χ²(n − 1)) and t the
    two-sided ``level`` quantile of Student's t with n − 1 degrees of freedom."""
    from scipy import stats

    n = max(2, least)
    while True:
        t = stats.t.ppf(0.5 + level / 2, n - 1)
        if stats.chi2.cdf((n - 1) * n * delta ** 2 / (t * sd) ** 2, n - 1) >= power:
            return n
        n += 1


def pilot_sd(method: dict, baseline: dict) -> dict[str, float]:
    """Per reading, the sd of the paired differences over the pilot seeds."""
    keys = sorted(k for k in method.keys() & baseline.keys() if k[0] in PILOT_SEEDS)
    return {r: float(np.std([readings(method[k])[r] - readings(baseline[k])[r]
                             for k in keys], ddof=1)) for r in READINGS}


def plan_entries(records: dict[str, dict], date: str, commit: str) -> list[dict[str, Any]]:
    """The pre-registration of every claim of ``PLANS`` from its pilot's evidence."""
    out = []
    for name, (pilot, fixed) in PLANS.items():
        claim, entry = CLAIMS[name], records[pilot]
        delta = DELTA[claim.metric]
        for split in claim.splits:
            for c in (c for c in claim.comparisons if c.decides):
                runs = entry["runs"][split]
                sd = pilot_sd(runs[c.method], runs[c.baseline])
                need = planned_n(max(sd.values()), delta)
                n = fixed or need
                out.append({"claim": name, "split": split,
                            "comparison": f"{c.method} − {c.baseline}", "delta": delta,
                            "power": POWER, "pilot": pilot,
                            "pilot_sd": {r: round(v, 4) for r, v in sd.items()},
                            "n_for_delta": need, "n": n, "seeds": list(range(n)),
                            "date": date, "commit": commit})
    return out


def planned(claim: str, split: str, method: str, baseline: str) -> dict[str, Any] | None:
    """The pre-registration of one comparison (None: not pre-registered)."""
    from protofl.reproduce.preregistration import PREREGISTERED

    for p in PREREGISTERED:
        if (p["claim"], p["split"], p["comparison"]) == (claim, split, f"{method} − {baseline}"):
            return p
    return None


def planned_text(plans: list[dict[str, Any]]) -> str:
    """``pre-registered 2026-12-07 (commit abc1234): n = 46 ...`` of one comparison's plan,
    or of several that share their n (a claim's deciding comparisons)."""
    p, need = plans[0], sorted({q["n_for_delta"] for q in plans})
    span = f"{need[0]}" if len(need) == 1 else f"{need[0]}-{need[-1]}"
    sds = [max(q["pilot_sd"].values()) for q in plans]
    sd = f"{sds[0]:.4f}" if len(sds) == 1 else f"{min(sds):.4f}-{max(sds):.4f}"
    extra = (f" (fixed in advance; a 90% half-width of at most ±{p['delta']:g} with "
             f"{p['power']:.0%} power would need {span}, from the {p['pilot']} pilot's sd {sd})"
             if need != [p["n"]] else
             f" for a 90% half-width of at most ±{p['delta']:g} with {p['power']:.0%} power, "
             f"from the {p['pilot']} pilot's sd {sd}")
    return (f"pre-registered {p['date']} (commit {p['commit'][:7]}): n = {p['n']} "
            f"(seeds 0-{p['n'] - 1}){extra}")
