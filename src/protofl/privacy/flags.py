"""Whether a finished run's privacy claim holds, from its ``config.json`` alone (reports)."""

from __future__ import annotations

from typing import Any


def not_private(config: dict[str, Any]) -> bool:
    """A run with client-level DP whose noise was drawn from its seed
    (``privacy.reproducible_noise``): anyone with its config can strip the noise."""
    p = config.get("privacy") or {}
    return float(p.get("noise_multiplier") or 0) > 0 and bool(p.get("reproducible_noise"))


def not_private_warning(runs: list[dict[str, Any]]) -> str:
    """One line naming the runs (``{folder, config}``) that are not private; "" if none."""
    bad = [str(r["folder"]) for r in runs if not_private(r.get("config") or {})]
    if not bad:
        return ""
    return (f"NOT PRIVATE: {len(bad)} run(s) drew their DP noise from the run seed "
            f"(privacy.reproducible_noise, for tests only), so their epsilon protects "
            f"nothing: {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")
