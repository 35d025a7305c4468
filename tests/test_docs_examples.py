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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import tomllib

import protofl

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
SECTIONS = ("getting-started", "how-to")
ELSEWHERE = {"how-to/flower-sites.md": "tests/test_flower_walkthrough.py"}
RUN, DATA = ("bash", "python"), ("text", "yaml", "toml", "file")
BLOCK = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```\s*$", re.S | re.M)

# `pip ARGS`: checked, not run (a test does not install packages)
PIP_CHECK = r'''
import os, re, shutil, subprocess, sys, tempfile, tomllib
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
    elif target not in (".", "protofl") and (repo / target / "pyproject.toml").is_file():
        with tempfile.TemporaryDirectory() as tmp:  # built from a copy: the tree stays clean
            shutil.copytree(repo / target, Path(tmp) / "src", ignore=shutil.ignore_patterns(
                "__pycache__", "build", "*.egg-info"))
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                            "--no-build-isolation", "--target", os.environ["DOCS_SITE"],
                            str(Path(tmp) / "src")], check=True)
'''


def pages() -> list[Path]:
    return sorted(p for s in SECTIONS for p in (DOCS / s).glob("*.md"))


def blocks(page: Path) -> list[tuple[str, str]]:
    """(kind, code) of every fenced block; a block with a title is a file: kind ``file``."""
    return [("file" if "title=" in info else kind, code)
            for kind, info, code in BLOCK.findall(page.read_text())]


def reader_folder(tmp: Path) -> dict[str, str]:
    """``tmp`` laid out as a reader's folder; the environment its commands run in."""
    for name in ("configs", "docs", "examples", "scripts"):
        if (REPO / name).exists():
            (tmp / name).symlink_to(REPO / name)
    bin_dir = tmp / ".bin"
    bin_dir.mkdir()
    for name, args in (("python", ""), ("python3", ""), ("protofl", " -m protofl.cli")):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}"{args} "$@"\n')
        (bin_dir / name).chmod(0o755)  # a script, not a link: a venv's python stays in it
    site = tmp / ".site"  # where `pip install ./examples/plugin` puts it
    site.mkdir()
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), str(site),
                                                        os.environ.get("PYTHONPATH")])),
               MPLBACKEND="Agg", DOCS_PIP_CHECK=PIP_CHECK, DOCS_SITE=str(site))
    return env


def script(page: Path) -> str:
    """The page's runnable blocks as one bash script, each after a line naming it on stderr
    (a Python block runs as ``python -`` with the block on its standard input)."""
    parts = [f'pip() {{ "{sys.executable}" -c "$DOCS_PIP_CHECK" "{REPO}" '
             f'"{protofl.__version__}" "$@"; }}']
    for i, (kind, code) in enumerate(blocks(page)):
        if kind in RUN:
            parts.append(f"echo '@@ block {i + 1} ({kind})' >&2")
            parts.append(code if kind == "bash" else f"python - <<'DOCS_PY'\n{code}DOCS_PY")
    return "\n".join(parts) + "\n"


def run_page(page: str, tmp: Path) -> str:
    """"" when the page's blocks all ran, else what went wrong."""
    folder = tmp / page.replace("/", "_")
    folder.mkdir()
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script(DOCS / page)],
                          cwd=folder, env=reader_folder(folder), capture_output=True,
                          text=True, timeout=600)
    if done.returncode == 0:
        return ""
    block = re.findall(r"^@@ (.*)$", done.stderr, re.M)
    return (f"{page}, {block[-1] if block else 'before its first block'}: exit "
            f"{done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")


def test_the_pages_have_examples_and_only_known_kinds_of_block():
    assert len(pages()) >= 8, pages()
    for page in pages():
        kinds = {kind for kind, _ in blocks(page)}
        name = page.relative_to(DOCS).as_posix()
        assert kinds <= set(RUN + DATA), (name, kinds - set(RUN + DATA))
        assert kinds & set(RUN) or page.name == "index.md" or name in ELSEWHERE, name
    for name, test in ELSEWHERE.items():  # the test named reads that page
        assert Path(name).name in (REPO / test).read_text(), (name, test)


def test_every_page_runs_as_written(tmp_path):
    """Two pages at a time (each in its own folder): the machine's two cores."""
    names = [p.relative_to(DOCS).as_posix() for p in pages()]
    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f for f in pool.map(lambda n: run_page(n, tmp_path),
                                        [n for n in names if n not in ELSEWHERE]) if f]
    assert not failures, "\n\n".join(failures)


def test_a_failing_block_is_named(tmp_path, monkeypatch):
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text("```bash\necho fine\n```\n\n```python\nraise SystemExit(3)\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "DOCS", page.parent)
    assert run_page("page.md", tmp_path).startswith("page.md, block 2 (python): exit 3")


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
