"""The installed wheel, checked from outside the source tree (``.ci/run`` runs it in a fresh
venv): every module of ``src/protofl`` is in the package and imports (those needing an extra
that is not installed are named, not failed), the version is the release's, and a short run
through the Python API writes its folder, with a report read back from it.

Usage: python wheel_smoke.py SOURCE_TREE WORK_DIR
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import sys
from pathlib import Path


def main(source: Path, work: Path) -> None:
    import protofl

    installed = Path(protofl.__file__).resolve().parent
    assert source.resolve() not in installed.parents, f"protofl imported from {installed}"
    assert protofl.__version__ == importlib.metadata.version("protofl"), protofl.__version__
    src = source / "src" / "protofl"
    wanted = sorted(p.relative_to(src) for p in src.rglob("*.py") if "__pycache__" not in p.parts)
    missing = [str(p) for p in wanted if not (installed / p).is_file()]
    assert not missing, f"not in the wheel: {missing}"
    skipped = []
    for rel in wanted:
        name = ".".join(("protofl", *rel.with_suffix("").parts)).removesuffix(".__init__")
        if name.endswith("__main__"):  # importing it runs the command line
            continue
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:  # an optional extra (flwr, mlflow, ...) not installed
            if (e.name or "").split(".")[0] == "protofl":
                raise
            skipped.append(f"{name} ({e.name})")
    print(f"{len(wanted)} modules in the wheel; not imported for want of an extra: "
          + (", ".join(skipped) or "none"))
    run = protofl.run({"algorithm": "fedavg", "rounds": 2, "data": {"name": "digits"},
                       "clients": {"per_round": 4}}, out=work / "api-run")
    assert [r["round"] for r in run.records] == [1, 2], run.records
    summary = json.loads((work / "api-run" / "summary.json").read_text())
    assert summary["provenance"]["protofl"] == protofl.__version__, summary["provenance"]

    from protofl.cli import main as cli

    assert cli(["report", str(work / "api-run"), "--out", str(work / "report.html")]) == 0
    assert "fedavg" in (work / "report.html").read_text()
    print(f"protofl {protofl.__version__} from {installed}: the wheel works")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
