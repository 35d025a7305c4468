"""Import circles between protofl's files: every ``protofl.*`` import (top level, inside
functions, under TYPE_CHECKING, relative, or a module named by a string), file to file.

    python3 scripts/imports.py [SRC]      # default: src/protofl

Prints the circles (strongly connected groups of two or more files, each with one shortest
cycle through it) and the pairs of files importing each other. A package import
(``from protofl.engine import runfolder``) is an edge to the module it names, or to the
package's ``__init__`` when the name is no module.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import deque
from pathlib import Path

MODULE_PATH = re.compile(r"protofl(\.\w+)+(:\w+)?")


def modules(src: Path) -> dict[str, Path]:
    out = {}
    for p in src.rglob("*.py"):
        parts = p.relative_to(src).with_suffix("").parts
        name = ".".join(("protofl",) + parts).removesuffix(".__init__")
        out[name] = p
    return out


def targets(path: Path, src: Path, known: set[str]) -> set[str]:
    package = ["protofl", *path.relative_to(src).parent.parts]
    found: set[str] = set()

    def add(module: str, names: list[str] = ()):
        subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in known]
        found.update(subs)
        if len(subs) < len(names) or not names:
            found.add(module)

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("protofl"):
                    add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            elif node.module and node.module.startswith("protofl"):
                module = node.module
            else:
                continue
            add(module, [a.name for a in node.names])
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and MODULE_PATH.fullmatch(node.value)):
            add(node.value.split(":")[0])
    return {t for t in found if t in known}


def graph(src: Path) -> dict[str, set[str]]:
    mods = modules(src)
    known = set(mods)
    return {m: targets(p, src, known) - {m} for m, p in mods.items()}


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of two or more files (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def shortest_cycle(g: dict[str, set[str]], start: str, within: set[str]) -> list[str]:
    prev, queue = {start: None}, deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(g[v] & within):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v,
                                                                                     start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return []


def main(src: Path) -> None:
    g = graph(src)
    comps = circles(g)
    pairs = sorted({tuple(sorted((a, b))) for a in g for b in g[a] if a in g.get(b, set())})
    print(f"{len(comps)} import circles (groups of files that import each other):")
    for comp in comps:
        print(f"  {len(comp)} files: {' -> '.join(shortest_cycle(g, comp[0], set(comp)))}")
    print(f"{len(pairs)} pairs of files importing each other:")
    for a, b in pairs:
        print(f"  {a} <-> {b}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
         / "src" / "protofl")
