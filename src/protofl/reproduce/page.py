"""docs/reproduction.md: the claim tables, the forest figure, the sensitivity table and the
claims in words, each generated into its marked section of the page."""

from __future__ import annotations

from pathlib import Path

from protofl.errors import ProtoflError
from protofl.report import outputs
from protofl.report.markdown import begin, end, merge_sections
from protofl.reproduce import evidence
from protofl.reproduce.figure import forest
from protofl.reproduce.sensitivity import sensitivity_markdown
from protofl.reproduce.tables import tables_markdown
from protofl.reproduce.words import words_markdown


def write_reproduction(sources: list[Path], md: Path, overwrite: bool = False,
                       evidence_dir: Path | None = None) -> Path:
    """Write (or update the generated section of) ``md`` with the claim tables of the
    reproduce folders and evidence files given; ``evidence_dir``: also write there the
    merged evidence the tables were read from, a file a claim. Every paper-budget comparison
    with two pairs or more is also drawn, in ``img/reproduction.png`` beside ``md``; the
    sensitivity table (``reproduction-sensitivity``) and the claims in words
    (``reproduction-words``) are generated into their own marked sections."""
    md = Path(md)
    if md.exists() and not overwrite:
        raise ProtoflError(f"{md} exists; pass --overwrite to update its generated section")
    outputs.writable(md)
    name = "reproduction"
    records = evidence.merge([Path(f) for f in sources])
    figure = forest(records, md.parent / "img" / "reproduction.png")
    alt = ("every comparison's mean difference and 95% interval, each reading coloured by "
           "where it lies against 0, deciding comparisons bold")
    glance = ([f"![{alt}]({figure.relative_to(md.parent).as_posix()})", ""]
              if figure else [])
    blocks = {name: [*glance, tables_markdown(records)],
              f"{name}-sensitivity": [sensitivity_markdown(records)],
              f"{name}-words": [words_markdown(records)]}
    old = md.read_text() if md.exists() else "# Reproduction\n"
    if evidence_dir is not None:
        evidence.write(records, evidence_dir)
    outputs.write_text(md, merge_sections(old, {k: "\n".join([begin(k), "", *v, "", end(k)])
                                                for k, v in blocks.items()}))
    return md
