"""What the per-round FFD metric adds to a round of the main suite's settings.

Method: for each dataset of ``protofl suite main`` (Synthetic(1,1) and non-IID digits, with
the suite's clients, local steps and metrics), a ``central`` reference run of ``--rounds``
rounds saves its weights in a temporary folder; then fedavg runs the same rounds twice with
the same seed, without and with ``metrics.ffd_reference`` (FFD on every round, as in the
suite). Reported per round: the round's wall-clock (``seconds`` of the run without FFD,
training and every other per-round metric included), the time spent in the FFD callback
(timed around ``FeatureFidelity.after_aggregate``: loading the reference weights, the
features of the probe under 10 client models and the reference, 10 MMD²), and the rise of
``seconds`` between the two runs. One torch thread; ``--probes`` lists the probe sizes.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from protofl.api import run_experiment
from protofl.config import config_from_dict, merge
from protofl.engine.callbacks import FeatureFidelity
from protofl.engine.experiment import Experiment
from protofl.suites import SUITES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--probes", default="128,256")
    args = ap.parse_args()
    torch.set_num_threads(1)
    spent = [0.0]
    timed = FeatureFidelity.after_aggregate

    def after_aggregate(self, exp, record, results):
        t = time.perf_counter()
        timed(self, exp, record, results)
        spent[0] += time.perf_counter() - t

    FeatureFidelity.after_aggregate = after_aggregate
    with tempfile.TemporaryDirectory() as tmp:
        for name, base in SUITES["main"].datasets.items():
            base = merge(base, {"rounds": args.rounds, "seed": 0})
            ref = Path(tmp) / name
            run_experiment(config_from_dict(merge(base, {"algorithm": "central",
                                                         "trainer": "sequential"})), ref)
            plain = Experiment(config_from_dict(merge(base, {"algorithm": "fedavg"}))).run()
            per_round = plain["seconds"] / args.rounds
            print(f"{name}: a fedavg round without FFD {per_round:.3f} s")
            for size in map(int, args.probes.split(",")):
                spent[0] = 0.0
                raw = merge(base, {"algorithm": "fedavg",
                                   "metrics": {"ffd_reference": str(ref), "ffd_probe": size}})
                s = Experiment(config_from_dict(raw)).run()
                ffd = spent[0] / args.rounds
                print(f"  probe {size:4d}: FFD {ffd:.3f} s per round ({100 * ffd / per_round:.0f}%"
                      f" of a round); seconds rose by "
                      f"{(s['seconds'] - plain['seconds']) / args.rounds:+.3f} s per round")


if __name__ == "__main__":
    main()
