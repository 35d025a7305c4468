"""How much a reproduce claim's verdict depends on fedmargin's reconstructed choices.

For each alternative (an ``algo.KEY=VALUE`` the text allows; docs/reproduction.md, "The
reconstruction, examined") this runs the claim's ``fedmargin`` variant at the paper budget
over the seeds with that one option changed, next to an existing ``protofl suite reproduce``
folder holding the claim's ``fedmargin`` and ``fedavg`` runs on the same seeds, and prints,
by the claim rule (``protofl.report.claims``), the alternative against protofl's default and
against FedAvg:

    python scripts/reconstruction_sensitivity.py runs/reproduce-paper --claim digits \\
        --out runs/sensitivity algo.reduce=mean algo.apm_reference=all

The runs go to ``OUT/<claim>/<KEY=VALUE>/fedmargin-alt/seed<N>`` (beside links to the
reference folder's two variants), so a stopped script continues where it was.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from protofl.config import apply_set, config_from_dict, merge
from protofl.report.claims import curves, paired, result_text
from protofl.reproduce.claims import CLAIMS, NO_COSTLY
from protofl.reproduce.plan import budget_config
from protofl.suites import execute, seeded


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reference", type=Path, help="a `protofl suite reproduce` output folder")
    p.add_argument("alternatives", nargs="+", metavar="algo.KEY=VALUE")
    p.add_argument("--claim", default="digits")
    p.add_argument("--split", default="default")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--out", type=Path, default=Path("runs/sensitivity"))
    p.add_argument("--jobs", type=int, default=None)
    args = p.parse_args()
    claim = CLAIMS[args.claim]
    seeds = [int(s) for s in args.seeds.split(",")]
    base = merge(merge(budget_config(claim, "paper"), claim.splits[args.split]),
                 claim.variants["fedmargin"])
    ref = (args.reference / claim.name / args.split).resolve()
    work = []
    for alt in args.alternatives:
        folder = args.out / claim.name / alt
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("fedmargin", "fedavg"):
            if not (folder / name).exists():
                (folder / name).symlink_to(ref / name)
        change: dict = {}
        apply_set(change, alt)
        for seed in seeds:
            raw = seeded(merge(merge(base, change), NO_COSTLY), seed, None)
            config_from_dict(raw)  # a bad alternative is one error before anything runs
            work.append((raw, str(folder / "fedmargin-alt" / f"seed{seed}")))
    execute(work, args.jobs, "sensitivity")
    for alt in args.alternatives:
        folder = args.out / claim.name / alt
        alt_runs = curves(folder / "fedmargin-alt", claim.metric)
        for baseline in ("fedmargin", "fedavg"):
            res = paired(alt_runs, curves(folder / baseline, claim.metric))
            print(f"{alt} − {baseline}: {result_text(res)}: {res['verdict']}")


if __name__ == "__main__":
    main()
