"""``protofl suite reproduce``: the seeds' claims at the seeds' protocols, one claim at a time.

A claim is one statement of a seed ("fedmargin robustly outperforms FedAvg on every
dataset") at one protocol (data, model, clients, rounds, local work), with the variants
that isolate the paper's components (client sampling ∝ size, partial work, weighting) and
the paired comparisons (method − baseline, same seed and partition) that settle it by the
rule of ``protofl.report.claims``. ``--budget paper`` runs the protocol as the paper states
it (where the paper is silent, the value's source is written beside it in ``sources`` and
in ``configs/``); ``--budget short`` shrinks rounds and local work so every claim whose
data is here runs end to end in minutes (a smoke test of the plan, not evidence).

Runs go to ``OUT/<claim>/<split>/<variant>/seed<N>`` and ``OUT/reproduce.json`` records,
per claim, the budget and whether it ran or why not (its data absent).
"""

from protofl.reproduce.claims import CLAIMS, PLAN_FILE, Claim, Comparison
from protofl.reproduce.plan import (
    BUDGETS,
    SEEDS,
    budget_config,
    claim_jobs,
    reproduce_plan,
    select,
    status,
    write_record,
)
from protofl.reproduce.run import run_reproduce

__all__ = ["BUDGETS", "CLAIMS", "PLAN_FILE", "SEEDS", "Claim", "Comparison", "budget_config",
           "claim_jobs", "reproduce_plan", "run_reproduce", "select", "status", "write_record"]
