"""What a report shows: one section per folder of runs given (run folders given one by one
share a section), each section a table per dataset."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from protofl.engine import runfolder
from protofl.errors import ProtoflError
from protofl.report import outputs
from protofl.report.compare import Table, load_runs, make_tables, natural_key


@dataclass
class Section:
    name: str
    tables: list[Table]

    @property
    def runs(self) -> list[dict]:
        return [r for t in self.tables for r in t.runs]


def find_runs(path: Path) -> list[Path]:
    """``path`` itself when it is a finished run folder, else every one below it."""
    path = Path(path)
    if (path / runfolder.SUMMARY).exists():
        return [path]
    if path.is_dir():
        found = sorted((s.parent for s in path.rglob(runfolder.SUMMARY)),
                       key=lambda p: natural_key(str(p)))
        if found:
            return found
        raise ProtoflError(f"no finished run folder (with {runfolder.SUMMARY}) under {path}")
    raise ProtoflError(f"{path} is not a run folder or a folder of runs")


def sections(paths: list[Path]) -> list[Section]:
    """A section per folder of runs, plus one (``run folders``) for those given directly."""
    single, groups = [], []
    for p in map(Path, paths):
        found = find_runs(p)
        if found == [p]:
            single.append(p)
        else:
            groups.append((str(p), found))
    if single:
        groups.insert(0, ("run folders", single))
    outputs.unique_runs([f for _, fs in groups for f in fs])  # each run counted once
    return [Section(name, make_tables(load_runs(fs))) for name, fs in groups]
