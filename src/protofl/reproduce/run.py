"""Running the claims: the encoders they start from, their runs, the record and the
verdict tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from protofl.reproduce.plan import encoder_path, reproduce_plan, select, write_record


def pretrain_encoders(names: str | None, budget: str, out: Path,
                      record: dict[str, dict]) -> None:
    """Train (or reuse) the encoder of every claim to run that starts from one."""
    from protofl.models.pretrain import PretrainSpec, shapes_encoder

    for claim in select(names):
        if claim.pretrain and record[claim.name]["status"] == "run":
            shapes_encoder(encoder_path(claim, budget, out),
                           PretrainSpec(**claim.pretrain[budget]))


def run_reproduce(names: str | None, budget: str, out: Path, jobs: int | None = None,
                  seeds: tuple[int, ...] | None = None,
                  overrides: dict[str, Any] | None = None,
                  splits: tuple[str, ...] | None = None, alternatives: bool = False,
                  kept: Path | None = None, variants: tuple[str, ...] | None = None,
                  executor: str = "local") -> str:
    """Run the claims named at ``budget`` (``splits``, ``variants``: only these;
    ``alternatives``: the reconstruction's alternatives instead; ``kept``: not the runs this
    evidence folder holds; ``executor``: local processes or Ray tasks) and return their
    verdict tables (Markdown); ``OUT/claims.md`` holds them too, with ``kept``'s runs merged
    in."""
    from protofl.config import config_from_dict
    from protofl.executor import execute
    from protofl.reproduce.tables import reproduction_markdown

    record, work = reproduce_plan(names, budget, out, seeds, overrides, splits, alternatives,
                                  kept, variants)
    for raw, _ in work:
        config_from_dict(raw)  # every config checked before anything runs
    write_record(out, record)  # first: a suite stopped early leaves a readable folder
    pretrain_encoders(names, budget, out, record)
    execute(work, jobs, f"reproduce ({budget})", executor)
    if any(entry.get("search") for entry in record.values()):  # then the searched claims' runs
        record, work = reproduce_plan(names, budget, out, seeds, overrides, splits,
                                      alternatives, kept, variants)
        write_record(out, record)
        execute(work, jobs, f"reproduce ({budget})", executor)
    text = reproduction_markdown([*([kept] if kept else []), out], only=list(record))
    (out / "claims.md").write_text(text + "\n")
    return text
