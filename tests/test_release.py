"""The release: one version (``protofl.__version__``, pyproject.toml's, which Flower reads
there, and the changelog's newest release) and a changelog in Keep a Changelog's form."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tomllib

import protofl

REPO = Path(__file__).resolve().parents[1]
CATEGORIES = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}


def releases(text: str) -> list[tuple[str, str]]:
    """(heading, body) of every ``## `` section of the changelog."""
    parts = re.split(r"^## (.*)$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def test_one_version_everywhere():
    assert re.fullmatch(r"\d+\.\d+\.\d+", protofl.__version__)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["version"] == protofl.__version__
    out = subprocess.run([sys.executable, "-m", "protofl.cli", "--version"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"protofl {protofl.__version__}"


def test_the_changelog_has_a_section_per_release_the_newest_this_one():
    sections = releases((REPO / "CHANGELOG.md").read_text())
    assert sections[0][0] == "[Unreleased]"
    versions = [re.fullmatch(r"\[(\d+\.\d+\.\d+)\] - (\d{4}-\d\d-\d\d)", h) for h, _ in
                sections[1:]]
    assert all(versions), [h for h, _ in sections[1:]]
    assert versions[0][1] == protofl.__version__
    numbers = [tuple(map(int, v[1].split("."))) for v in versions]
    assert numbers == sorted(numbers, reverse=True) and len(set(numbers)) == len(numbers)
    for heading, body in sections:
        kinds = re.findall(r"^### (.*)$", body, flags=re.M)
        assert set(kinds) <= CATEGORIES, (heading, kinds)
        assert len(kinds) == len(set(kinds)), heading
        if heading != "[Unreleased]":
            assert kinds, heading
