"""Per-round wall time of the three-site walkthrough (docs/how-to/flower-sites.md) on
Flower's deployment engine, with each node's data mapped from its cache (the default) against
rebuilt from its files for every message (``data-cache=false``, how every round ran before
the cache).

    python benchmarks/flower_deploy.py                   # 4 rounds, 40 images/class/site
    python benchmarks/flower_deploy.py --images 200 --size 128

Each mode starts its own SuperLink (TLS, SuperNode authentication) and three registered
SuperNodes on 127.0.0.1, each with its own image folder (3 classes), and runs the
walkthrough's ``derm-sites.yaml`` (fedmargin, ResNet-18, every site every round, 1 local
epoch of batch 32, evaluated every round) for ``--rounds`` rounds. Every message is a fresh
``flwr-clientapp`` process in both modes (flwr 1.42). Round 1 (the first build, and the
cache's writing) is left out: the figure is the mean of rounds 2..R from the run's
``metrics.jsonl``. Prints ``[flower-deploy] vs cold: protofl X s/round, other Y s/round,
ratio Z`` (protofl = cached, other = cold; ratio > 1: the cache is faster).

What the cache saves is each message's data build, which grows with the site (a process
start and the imports do not): ``--build-images N`` also times a node's build alone, in
this process, for a site of N images per class of ``--build-source`` px resized to
``--size`` (two builds a round: the train and the evaluate message), and prints
``[flower-deploy site build] vs cold: ...`` in the same form.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

from deployment import Deployment, wait_for  # noqa: E402
from sitefiles import write_site  # noqa: E402

from protofl.config import config_from_dict  # noqa: E402
from protofl.data.store import CACHE_ENV  # noqa: E402

CLASSES = ["nevus", "melanoma", "keratosis"]


def walkthrough(rounds: int, size: int):
    """The walkthrough's derm-sites.yaml at ``size`` px, without a server test set."""
    return config_from_dict({
        "algorithm": "fedmargin", "rounds": rounds, "model": {"name": "resnet18"},
        "data": {"name": "site", "num_clients": 3, "classes": CLASSES,
                 "input_shape": [3, size, size], "image_size": size},
        "clients": {"per_round": 3, "local_epochs": 1, "batch_size": 32, "lr": 0.01}})


def per_round(root: Path, sites: list[Path], rounds: int, size: int, cache: bool) -> float:
    """Mean wall seconds of rounds 2..R of one deployment run."""
    root.mkdir()
    os.environ[CACHE_ENV] = str(root / "cache")  # each mode starts with an empty cache
    dep = Deployment(root)
    try:
        dep.up(sites, old=False, extra="" if cache else "data-cache=false")
        out = root / "run"
        dep.flwr_run(walkthrough(rounds, size), out, round_timeout=900)
        wait_for(lambda: (out / "summary.json").exists(), 300 + 240 * rounds,
                 "the run to finish", every=2)
        seconds = [json.loads(x)["seconds"] for x in
                   (out / "metrics.jsonl").read_text().splitlines()]
        return (seconds[-1] - seconds[0]) / (len(seconds) - 1)
    finally:
        dep.down()


def site_build(base: Path, images: int, source: int, size: int, repeats: int = 3
               ) -> dict[str, float]:
    """Seconds of one node build (the train message's), cold and mapped, mean of
    ``repeats``."""
    from protofl.flower import setup

    site = write_site(base / "big", dict.fromkeys(CLASSES, images), CLASSES, size=source,
                      mode="RGB")
    cfg = json.dumps(walkthrough(2, size).to_dict())
    os.environ[CACHE_ENV] = str(base / "build-cache")
    times = {}
    for name, cache in (("cold", False), ("cached", True)):
        setup.build_site(cfg, str(site), "", 0, cache)  # (cached: writes the cache)
        spent = []
        for _ in range(repeats):
            setup.build_site.cache_clear()  # a new message: nothing kept in memory
            start = time.perf_counter()
            setup.build_site(cfg, str(site), "", 0, cache)
            spent.append(time.perf_counter() - start)
        times[name] = sum(spent) / repeats
    return times


def main() -> None:
    import history  # benchmarks/history.py: record the comparison lines
    history.hook()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--images", type=int, default=40, help="images per class per site")
    p.add_argument("--size", type=int, default=64, help="image side, px")
    p.add_argument("--build-images", type=int, default=0,
                   help="also time a node's build for a site of N images per class")
    p.add_argument("--build-source", type=int, default=256, help="their side before resizing")
    p.add_argument("--skip-deploy", action="store_true", help="only the build timing")
    args = p.parse_args()
    if args.rounds < 2:
        p.error("--rounds must be at least 2 (round 1 is left out)")
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        sites = [write_site(base / f"site{k}", dict.fromkeys(CLASSES, args.images), CLASSES,
                            size=args.size, mode="RGB", seed=k) for k in range(3)]
        if args.build_images:
            b = site_build(base, args.build_images, args.build_source, args.size)
            print(f"[flower-deploy site build] vs cold: protofl {2 * b['cached']:.3f} s/round, "
                  f"other {2 * b['cold']:.3f} s/round, ratio {b['cold'] / b['cached']:.2f} "
                  f"({3 * args.build_images} images of {args.build_source} px)", flush=True)
        if args.skip_deploy:
            return
        times = {}
        for name, cache in (("cold", False), ("cached", True)):
            start = time.perf_counter()
            times[name] = per_round(base / name, sites, args.rounds, args.size, cache)
            print(f"{name}: {times[name]:.2f} s/round ({time.perf_counter() - start:.0f} s "
                  "in all)", flush=True)
    print(f"[flower-deploy] vs cold: protofl {times['cached']:.3f} s/round, other "
          f"{times['cold']:.3f} s/round, ratio {times['cold'] / times['cached']:.2f}")


if __name__ == "__main__":
    main()
