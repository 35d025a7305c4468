"""The README: short, its two set-up commands the ones CI runs, its Python example runs as
written, its links lead somewhere, and no dated measurement."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SETUP = ("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e . && "
         "protofl suite main",
         "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e "
         '".[dev]" && python -m pytest -q -n 2 --dist loadfile')


def test_the_readme_python_example_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no Python example"
    assert len(blocks[0].strip().splitlines()) <= 12
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)  # noqa: S102
    run, torch = scope["run"], scope["torch"]
    assert len(scope["frame"]) == len(run.records) == 3
    assert set(torch.load(tmp_path / "fedmargin.pt")) == set(scope["model"].state_dict())


def test_the_readme_is_short_and_opens_with_the_two_setup_commands():
    text = README.read_text()
    assert len(text) < 8000, len(text)
    first = re.search(r"```(\w*)\n(.*?)```", text, flags=re.S)
    assert first[1] == "bash" and tuple(first[2].strip().splitlines()) == SETUP
    ci = (REPO / ".ci" / "run").read_text()
    assert "torch==2.13.0" in ci and "python3 -m pytest -q -n 2 --dist loadfile" in ci


def test_the_readme_links_lead_somewhere_and_it_dates_no_measurement():
    text = README.read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not re.match(r"[a-z]+:", target):
            assert (REPO / target).exists(), target
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text)
    assert not re.search(r"\b\d+ min \d+ s\b", text)
