"""The docs site's build helpers (``scripts/``): links resolved where they were written, and
the docstrings' reST habits read as Markdown. CI builds the site itself with ``mkdocs build
--strict``."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def page(uri: str):
    return SimpleNamespace(file=SimpleNamespace(src_uri=uri))


def test_links_are_read_where_they_were_written(caplog):
    pytest.importorskip("mkdocs")
    hooks = load("mkdocs_hooks")
    md = ("[a](../configuration.md#x) [b](../../src/protofl/api.py) [c](https://x.org) "
          "[d](#here) ![e](../img/reproduction.png)\n\n```bash\n[f](../../nothing.md)\n```\n")
    out = hooks.on_page_markdown(md, page("how-to/gpu.md"), None, None)
    assert out.startswith("[a](../configuration.md#x) b [c](https://x.org) [d](#here) "
                          "![e](../img/reproduction.png)")
    assert "[f](../../nothing.md)" in out  # code is left alone
    # the benchmarks page is benchmarks/README.md: its links are relative to benchmarks/
    out = hooks.on_page_markdown("[g](../docs/datasets.md) [h](heavy_tail.py) "
                                 "[i](../CHANGELOG.md)", page("benchmarks.md"), None, None)
    assert out == "[g](datasets.md) h [i](changelog.md)"  # h: a source file, its text kept
    assert not caplog.records
    hooks.on_page_markdown("[j](../../src/gone.py)", page("how-to/gpu.md"), None, None)
    assert "src/gone.py" in caplog.text  # a warning: --strict fails on it


def test_rst_roles_and_literal_blocks_become_markdown():
    pytest.importorskip("griffe")
    rst = load("griffe_rst")
    doc = ("Returns a :class:`~protofl.api.Run` (see :func:`run`). Example::\n\n"
           "    run = protofl.run({})\n    print(run)\n\nAfter it.")
    assert rst.markdown(doc) == ("Returns a `protofl.api.Run` (see `run`). Example:\n\n"
                                 "```python\nrun = protofl.run({})\nprint(run)\n```\n\n"
                                 "After it.")
    assert rst.markdown("plain ``code`` stays") == "plain ``code`` stays"
    assert not re.search(r":class:", rst.markdown(":class:`A` and :data:`B`"))
