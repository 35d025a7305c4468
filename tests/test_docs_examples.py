"""Every shell and Python block of the site's Getting started and How-to pages runs as
written, in the order a reader meets them, one temporary folder per page (a reader's working
folder: ``configs/``, ``examples/`` and ``scripts/`` are the repository's), so the pages
cannot rot. ``protofl`` and ``python`` are this interpreter's; ``pip`` does not install but
checks what it is asked for: every extra named must exist in pyproject.toml, every path
must exist in the repository and a wheel must be this release's. ``text``, ``yaml`` and
``toml`` blocks are output or files, not commands. The budgets are the pages' own (a few
rounds); a page whose blocks another test runs as written is named in ``ELSEWHERE``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import protofl

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
SECTIONS = ("getting-started", "how-to")
ELSEWHERE: dict[str, str] = {}
RUN, DATA = ("bash", "python"), ("text", "yaml", "toml")
BLOCK = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)

# `pip ARGS`: checked, not run (a test does not install packages)
PIP_CHECK = r'''
import re, sys, tomllib
from pathlib import Path
repo, version, args = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
extras = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["optional-dependencies"]
if not args or args[0] != "install":
    sys.exit(f"pip: only `pip install` is checked, not {args}")
for arg in (a for a in args[1:] if not a.startswith("-")):
    target, _, wanted = arg.partition("[")
    for extra in filter(None, wanted.rstrip("]").split(",")):
        if target in (".", "protofl") and extra not in extras:
            sys.exit(f"pip: protofl has no extra {extra!r} ({sorted(extras)})")
    if target.endswith(".whl"):
        name = Path(target).name
        if name != f"protofl-{version}-py3-none-any.whl":
            sys.exit(f"pip: {name} is not this release's wheel (protofl {version})")
    elif target != "protofl" and not (repo / target).exists():
        sys.exit(f"pip: {target} is not in the repository")
'''


def pages() -> list[Path]:
    return sorted(p for s in SECTIONS for p in (DOCS / s).glob("*.md"))


def blocks(page: Path) -> list[tuple[str, str]]:
    return BLOCK.findall(page.read_text())


def reader_folder(tmp: Path) -> dict[str, str]:
    """``tmp`` laid out as a reader's folder; the environment its commands run in."""
    for name in ("configs", "docs", "examples", "scripts"):
        if (REPO / name).exists():
            (tmp / name).symlink_to(REPO / name)
    bin_dir = tmp / ".bin"
    bin_dir.mkdir()
    for name in ("python", "python3"):
        (bin_dir / name).symlink_to(sys.executable)
    (bin_dir / "protofl").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m protofl.cli "$@"\n')
    (bin_dir / "protofl").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"),
                                                        os.environ.get("PYTHONPATH")])),
               MPLBACKEND="Agg", DOCS_PIP_CHECK=PIP_CHECK)
    return env


def test_the_pages_have_examples_and_only_known_kinds_of_block():
    assert len(pages()) >= 8, pages()
    for page in pages():
        kinds = {kind for kind, _ in blocks(page)}
        assert kinds <= set(RUN + DATA), (page, kinds - set(RUN + DATA))
        assert kinds & set(RUN) or page.name == "index.md" or page.name in ELSEWHERE, page


@pytest.mark.parametrize("page", [p.relative_to(DOCS).as_posix() for p in pages()])
def test_the_page_runs_as_written(page, tmp_path, monkeypatch):
    if page in ELSEWHERE:
        pytest.skip(f"run as written by {ELSEWHERE[page]}")
    env = reader_folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(REPO / "src"), *sys.path])
    preamble = (f'pip() {{ "{sys.executable}" -c "$DOCS_PIP_CHECK" "{REPO}" '
                f'"{protofl.__version__}" "$@"; }}\n')
    scope: dict = {"__name__": "__main__"}
    for i, (kind, code) in enumerate(blocks(DOCS / page)):
        where = f"{page}, block {i + 1} ({kind})"
        if kind == "bash":
            done = subprocess.run(["bash", "-euo", "pipefail", "-c", preamble + code],
                                  cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=300)
            assert done.returncode == 0, f"{where}:\n{code}\n{done.stdout}\n{done.stderr}"
        elif kind == "python":
            exec(compile(code, where, "exec"), scope)  # noqa: S102


def test_the_pip_check_has_teeth(tmp_path):
    env = reader_folder(tmp_path)
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert "flower" in extras
    for args, ok in ((["install", "protofl[flower]"], True), (["install", "protofl[nope]"], False),
                     (["install", "-e", ".[dev]"], True), (["install", "no/such/dir"], False),
                     (["install", f"dist/protofl-{protofl.__version__}-py3-none-any.whl"], True),
                     (["install", "dist/protofl-0.0.1-py3-none-any.whl"], False)):
        done = subprocess.run([sys.executable, "-c", PIP_CHECK, str(REPO),
                               protofl.__version__, *args], env=env, capture_output=True)
        assert (done.returncode == 0) == ok, (args, done.stderr)
