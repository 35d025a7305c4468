"""A Griffe extension for the API reference (``mkdocs.yml``): protofl's docstrings are written
in reStructuredText's small habits, which Markdown does not read. Roles such as
``:class:`Run``` become code spans, and a paragraph ending ``::`` followed by an indented
block becomes a paragraph ending ``:`` and a fenced code block."""

from __future__ import annotations

import re
import textwrap

import griffe

ROLE = re.compile(r":(?:class|func|meth|attr|data|mod|obj|exc):`~?([^`]+)`")


def markdown(doc: str) -> str:
    """``doc`` with its roles and literal blocks in Markdown."""
    lines, out, i = ROLE.sub(r"`\1`", doc).split("\n"), [], 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        if not line.rstrip().endswith("::"):
            continue
        out[-1] = line.rstrip()[:-1].rstrip() if line.strip() == "::" else line.rstrip()[:-1]
        block = []
        while i < len(lines) and (not lines[i].strip() or lines[i].startswith((" ", "\t"))):
            block.append(lines[i])
            i += 1
        while block and not block[-1].strip():
            block.pop()
        code = textwrap.dedent("\n".join(b for b in block)).strip("\n")
        out += ["", "```python", code, "```", ""]
    return "\n".join(out)


class RstToMarkdown(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
