"""The comparison rule of ``protofl suite reproduce`` (protofl.report.claims) against
hand-worked numbers, and the pairing of run folders by seed and partition."""

import json
import math

import pytest

from protofl.errors import ProtoflError
from protofl.report.claims import curve, curves, paired, readings, side, t_interval, verdict


def test_readings_last_tenth_and_area():
    rows = [{"round": t, "accuracy": t / 10} for t in range(1, 11)]  # 0.1 .. 1.0
    assert readings(curve(rows, "accuracy")[1]) == pytest.approx({"last": 1.0, "area": 0.55})
    # 11 evaluated rounds: ceil(1.1) = 2 in the tail, (1.0 + 1.1) / 2
    rows.append({"round": 11, "accuracy": 1.1})
    assert readings(curve(rows, "accuracy")[1])["last"] == pytest.approx(1.05)
    # rows without the metric (not evaluated) do not count
    rows.append({"round": 12})
    assert curve(rows, "accuracy")[0] == list(range(1, 12))
    assert readings(curve(rows, "accuracy")[1])["last"] == pytest.approx(1.05)
    with pytest.raises(ProtoflError):
        curve([{"round": 1}], "miou")


def test_t_interval_by_hand():
    # d = 1..5: mean 3, sd = sqrt(10 / 4) = 1.5811, se = 0.70711, t(0.975, 4) = 2.776445
    iv = t_interval([1, 2, 3, 4, 5])
    half = 2.776445 * math.sqrt(2.5) / math.sqrt(5)  # 1.963243
    assert iv["n"] == 5 and iv["mean"] == pytest.approx(3.0)
    assert iv["lo"] == pytest.approx(3 - half, abs=1e-5)
    assert iv["hi"] == pytest.approx(3 + half, abs=1e-5)
    # two values 0.1, 0.3: mean 0.2, se = 0.1, t(0.975, 1) = 12.7062
    iv = t_interval([0.1, 0.3])
    assert (iv["lo"], iv["hi"]) == pytest.approx((0.2 - 1.270620, 0.2 + 1.270620), abs=1e-5)
    assert math.isnan(t_interval([0.5])["lo"])


def _iv(lo, hi, n=5):
    return {"mean": (lo + hi) / 2, "lo": lo, "hi": hi, "n": n}


def test_verdict_rule():
    assert side(_iv(0.01, 0.2)) == "above" and side(_iv(-0.3, 0.0)) == "below"
    assert side(_iv(-0.1, 0.1)) == "straddles" and side(_iv(0.0, 0.1)) == "straddles"
    assert verdict({"last": _iv(0.01, 0.2), "area": _iv(0.02, 0.1)}) == "reproduced"
    assert verdict({"last": _iv(-0.2, -0.01), "area": _iv(-0.3, 0.0)}) == "not reproduced"
    assert verdict({"last": _iv(0.01, 0.2), "area": _iv(-0.1, 0.1)}) == "inconclusive"
    assert verdict({"last": _iv(0.01, 0.2), "area": _iv(-0.2, -0.1)}) == "inconclusive"
    # fewer than 5 pairs: never decisive
    assert verdict({"last": _iv(0.1, 0.2, 4), "area": _iv(0.1, 0.2, 4)}) == "inconclusive"


def _run(folder, seed, values, data_seed=None):
    folder.mkdir(parents=True)
    data_seed = seed if data_seed is None else data_seed
    (folder / "config.json").write_text(json.dumps({"seed": seed, "data": {"seed": data_seed}}))
    (folder / "metrics.jsonl").write_text(
        "".join(json.dumps({"round": t + 1, "accuracy": v}) + "\n" for t, v in enumerate(values)))
    (folder / "summary.json").write_text(json.dumps({"algorithm": "x", "dataset": "y"}))


def test_paired_by_seed_and_partition(tmp_path):
    # method - baseline per seed, last reading (1 of 5 rounds) and area (mean of 5)
    for s in range(5):
        _run(tmp_path / "m" / f"seed{s}", s, [0.5] * 4 + [0.6 + 0.01 * s])
        _run(tmp_path / "b" / f"seed{s}", s, [0.4] * 4 + [0.5])
    _run(tmp_path / "m" / "seed9", 9, [0.9] * 5)  # no baseline of seed 9: left out
    (tmp_path / "b" / "seed4" / "summary.json").unlink()  # unfinished: left out
    res = paired(curves(tmp_path / "m", "accuracy"), curves(tmp_path / "b", "accuracy"))
    assert res["n"] == 4
    # last: 0.10, 0.11, 0.12, 0.13 -> mean 0.115; area: 0.1 + 0.002 s
    assert res["intervals"]["last"]["mean"] == pytest.approx(0.115)
    assert res["intervals"]["area"]["mean"] == pytest.approx(0.1 + 0.002 * 1.5)
    assert res["means"]["baseline"]["last"] == pytest.approx(0.5)
    assert res["verdict"] == "inconclusive"  # 4 pairs < 5
    _run(tmp_path / "b" / "seed7", 7, [0.4] * 5, data_seed=0)
    _run(tmp_path / "m" / "seed7", 7, [0.4] * 5, data_seed=1)  # another partition: unpaired
    assert paired(curves(tmp_path / "m", "accuracy"),
                  curves(tmp_path / "b", "accuracy"))["n"] == 4
