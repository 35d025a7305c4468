"""MkDocs hooks (``mkdocs.yml``): pages kept outside ``docs/`` join the site, and every relative
link is resolved against the file it was written in.

- ``benchmarks/README.md`` becomes ``benchmarks.md`` and ``CHANGELOG.md`` ``changelog.md``.
- A link from any page is read relative to that page's own place in the repository: one into
  ``docs/`` (or to a page joined above) is rewritten to the page in the site; one to any other
  file of the repository (a source file, a config) keeps its text, without a link, as the site
  does not serve the tree. A link to a file the repository lacks is a warning, so
  ``mkdocs build --strict`` fails on it.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.plugins.protofl")
ROOT = Path(__file__).resolve().parents[1]
JOINED = {"benchmarks.md": "benchmarks/README.md", "changelog.md": "CHANGELOG.md"}
LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.S | re.M)


def on_files(files: Files, config) -> Files:
    for uri, source in JOINED.items():
        files.append(File.generated(config, uri, abs_src_path=str(ROOT / source)))
    return files


def source_of(uri: str) -> str:
    """The repository path a page was written at."""
    return JOINED.get(uri, f"docs/{uri}")


def relink(match: re.Match, page_uri: str) -> str:
    bang, text, target = match.groups()
    if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target, re.I):
        return match.group(0)
    path, _, anchor = target.partition("#")
    here = posixpath.dirname(source_of(page_uri))
    repo_path = posixpath.normpath(posixpath.join(here, path))
    back = {source: uri for uri, source in JOINED.items()}
    if repo_path in back:
        site_path = back[repo_path]
    elif repo_path.startswith("docs/"):
        site_path = repo_path.removeprefix("docs/")
    else:
        if not (ROOT / repo_path).exists():
            log.warning("%s links to %s, which the repository lacks", source_of(page_uri),
                        target)
        return text if not bang else match.group(0)
    rel = posixpath.relpath(site_path, posixpath.dirname(page_uri) or ".")
    return f"{bang}[{text}]({rel}{'#' + anchor if anchor else ''})"


def on_page_markdown(markdown: str, page, config, files) -> str:
    uri = page.file.src_uri
    out, last = [], 0
    for fence in FENCE.finditer(markdown):
        out.append(LINK.sub(lambda m: relink(m, uri), markdown[last:fence.start()]))
        out.append(fence.group(0))
        last = fence.end()
    out.append(LINK.sub(lambda m: relink(m, uri), markdown[last:]))
    return "".join(out)
