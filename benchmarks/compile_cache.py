"""The compiled trainer's first round, with torch's compile caches cold and then warm.

    python benchmarks/compile_cache.py                 # mlp: 30 clients x 20 steps
    python benchmarks/compile_cache.py --workloads mlp,cnn --steps 8

Each run is a fresh process (``speed.py --child compiled WORKLOAD``: no warm-up, 2 timed
rounds) with ``PROTOFL_CACHE`` a new empty folder and ``TORCHINDUCTOR_CACHE_DIR`` unset, so
torch's caches go to ``<PROTOFL_CACHE>/torch`` (``engine/cache.py``). ``cold``: the first run
(every graph compiled); ``warm``: a second process on the same folder (the graphs from the FX
graph and AOT autograd caches). Prints ``[workload] first compiled round: cold X s, warm Y s,
later rounds Z s``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def first_rounds(name: str, steps: int | None, cache: str) -> list[float]:
    sys.path.insert(0, HERE)
    from workloads import WORKLOADS

    steps = steps or WORKLOADS[name]["steps"]
    cmd = [sys.executable, os.path.join(HERE, "speed.py"), "--child", "compiled", name,
           "--warmup", "0", "--rounds", "2", "--threads", "1", "--workers", "1",
           "--device", "cpu", "--flower-gpus", "0", "--steps", str(steps)]
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(PROTOFL_CACHE=cache, PYTHONPATH=os.pathsep.join(
        [HERE, *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)["times"]["compiled"]
    raise SystemExit(f"{name}: {(out.stderr.strip().splitlines() or ['no output'])[-1]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="mlp")
    ap.add_argument("--steps", type=int, default=None, help="local steps (default: the "
                    "workload's)")
    a = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}", flush=True)
    for name in a.workloads.split(","):
        with tempfile.TemporaryDirectory(prefix="protofl-compile-cache-") as cache:
            cold = first_rounds(name, a.steps, cache)
            warm = first_rounds(name, a.steps, cache)
        print(f"[{name}] first compiled round: cold {cold[0]:.1f} s, warm {warm[0]:.1f} s, "
              f"later rounds {warm[1]:.2f} s (load average {os.getloadavg()[0]:.1f})",
              flush=True)


if __name__ == "__main__":
    main()
