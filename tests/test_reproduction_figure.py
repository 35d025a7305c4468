"""The reproduction page's forest figure: each reading coloured by its own interval, the
deciding comparisons first within their claim, one group per claim."""

from protofl.reproduce import figure
from protofl.reproduce.claims import CLAIMS


def test_each_reading_is_coloured_by_where_its_own_interval_lies():
    assert figure.reading_colour({"lo": 0.001, "hi": 0.2}) == "tab:green"
    assert figure.reading_colour({"lo": -0.3, "hi": -0.01}) == "tab:red"
    assert figure.reading_colour({"lo": -0.1, "hi": 0.1}) == "tab:gray"
    assert figure.reading_colour({"lo": 0.0, "hi": 0.1}) == "tab:gray"  # touching 0: across


def _entry(claim, pairs):
    """A paper-budget evidence entry with ``pairs`` seeds of every variant (curves of 10
    values, a variant's level set by its seed and its name's rank)."""
    labels = {label for c in claim.comparisons for label in (c.method, c.baseline)}
    runs = {label: {(s, s): [0.5 + 0.01 * s + 0.001 * i] * 10 for s in range(pairs)}
            for i, label in enumerate(sorted(labels))}
    return {"status": "run", "budget": "paper", "splits": list(claim.splits),
            "runs": {split: runs for split in claim.splits}}


def test_rows_put_the_deciding_comparisons_first_and_group_by_claim(tmp_path):
    name = "digits"
    claim = CLAIMS[name]
    entry = _entry(claim, 3)
    groups = figure._rows({name: entry, "synthetic": {**entry, "budget": "short"}})
    assert len(groups) == 1  # the short budget is not drawn
    decides = [row[1] for row in groups[0]]
    assert decides == sorted(decides, reverse=True) and decides[0] and not decides[-1]
    assert len(groups[0]) == len(claim.comparisons) * len(claim.splits)
    assert figure.forest({name: entry}, tmp_path / "f.png").stat().st_size > 0
    assert figure.forest({name: _entry(claim, 1)}, tmp_path / "g.png") is None
