"""The config's walk from ``protofl.run``: the protofl functions that receive the run's
config (a ``Config``, a ``RunSpec`` or one of their sections: an instance of a class defined
in ``protofl.config`` or ``protofl.engine.spec``) as an argument, in call order, for a
one-round run of FedAvg on digits.

    python3 scripts/config_walk.py [--show]

A stop is a run of consecutive such calls in one module; a climb is a stop in a higher layer
than the stop before it (the layers of docs/architecture.md, as tests/test_architecture.py
declares them). Prints the counts, and with ``--show`` the stops.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_architecture import layer_of  # noqa: E402

CONFIG_MODULES = ("protofl.config", "protofl.engine.spec")
RUN = {"algorithm": "fedavg", "rounds": 1, "data": {"name": "digits", "num_clients": 4},
       "clients": {"per_round": 2}, "metrics": {"every": 1}}


def walk() -> list[tuple[str, str]]:
    """``(module, function)`` of every call that receives a part of the config."""
    import protofl

    calls = []

    def seen(frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("protofl.") or (
                module in CONFIG_MODULES and frame.f_code.co_name.startswith("__")):
            return  # not protofl's, or a config section being made (dataclasses.replace)
        code = frame.f_code
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if any(type(frame.f_locals.get(n)).__module__ in CONFIG_MODULES for n in names):
            calls.append((module, code.co_name))

    sys.setprofile(seen)
    try:
        protofl.run(RUN)
    finally:
        sys.setprofile(None)
    return calls


def stops(calls: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    for module, fn in calls:
        if out and out[-1][0] == module:
            out[-1][1].append(fn)
        else:
            out.append((module, [fn]))
    return out


def main() -> None:
    walked = stops(walk())
    climbs = sum(layer_of(b) > layer_of(a) for (a, _), (b, _) in zip(walked, walked[1:]))
    if "--show" in sys.argv:
        for module, fns in walked:
            print(f"  {layer_of(module)} {module}: {', '.join(dict.fromkeys(fns))}")
    print(f"the config's walk from protofl.run: {len(walked)} stops, {climbs} climbs back up")


if __name__ == "__main__":
    main()
