"""Plugins: what a config names by a built-in name, an installed entry point or an import path.

Wherever protofl takes the name of an algorithm, model, dataset, partition scheme, trainer or
callback (a metric), it also takes

- ``package.module:Name``, an import path (Lightning's ``class_path``, Flower's components);
- a name that an installed distribution declares in the entry-point group of that kind
  (``protofl.algorithms``, ``protofl.models``, ...: :data:`GROUPS`), listed by
  ``protofl algorithms`` / ``protofl datasets`` beside the built-ins;
- from Python, the object itself (a class or a factory): :func:`register` names it by its
  import path for the config.

Each plugin a run uses is recorded in its ``config.json`` under ``plugins`` with the
distribution and version it came from (:func:`origin`); a resumed run and a Flower node check
them (:func:`check`), so a plugin that is missing or of another version stops with one line
naming its package.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import importlib.util
import inspect
import sys
from collections.abc import Iterable
from typing import Any

from protofl.errors import ProtoflError

# the entry-point group of each kind of plugin ("protofl.algorithms", ...: group names, which
# are not modules)
GROUPS = {kind: "protofl." + group for kind, group in (
    ("algorithm", "algorithms"), ("model", "models"), ("dataset", "datasets"),
    ("partition", "partitions"), ("trainer", "trainers"), ("callback", "callbacks"))}

_registered: dict[str, Any] = {}  # import path -> an object handed over from Python


def is_path(name: str) -> bool:
    """Whether ``name`` is an import path ``module:attribute``."""
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr)


def path_of(obj: Any) -> str:
    """The import path ``module:qualified.name`` of a class or function, or of an object a
    module holds by name (a ``DatasetSpec`` constant)."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        return f"{module}:{qualname}"
    for mod_name, mod in list(sys.modules.items()):
        for attr, value in list(vars(mod).items()) if mod is not None else ():
            if value is obj and not attr.startswith("_"):
                return f"{mod_name}:{attr}"
    raise ProtoflError(f"{type(obj).__name__} object has no import path: pass a class, a "
                       "function, or an object a module holds by name")


# the config keys that name plugins (a list names one per entry)
KEYS = ("algorithm", "trainer", "data.name", "data.partition", "model.name", "model.per_client",
        "callbacks")


def name_objects(raw: dict[str, Any]) -> dict[str, Any]:
    """A raw config (the YAML's keys) with every plugin given as an object from Python (a
    class, a factory, a ``DatasetSpec``) replaced by its import path (:func:`register`)."""
    def named(value: Any) -> Any:
        if isinstance(value, list):
            return [named(v) for v in value]
        return value if value is None or isinstance(value, (str, int, float, bool, dict)) else (
            register(value))

    out = dict(raw)
    for key in KEYS:
        section, _, leaf = key.rpartition(".")
        holder = out.get(section) if section else out
        if not isinstance(holder, dict) or leaf not in holder:
            continue
        if section:
            holder = out[section] = dict(holder)
        holder[leaf] = named(holder[leaf])
    return out


def register(obj: Any) -> str:
    """Name ``obj`` (a class or factory handed over from Python) by its import path, and keep
    it, so this process finds it even where the path cannot be imported again (a class
    defined in a notebook; such a run cannot be resumed from another process)."""
    path = path_of(obj)
    _registered[path] = obj
    return path


def entry_points(kind: str) -> dict[str, metadata.EntryPoint]:
    """The installed entry points of ``kind``'s group, by name."""
    return {ep.name: ep for ep in metadata.entry_points(group=GROUPS[kind])}


def names(kind: str, builtins: Iterable[str]) -> list[str]:
    """The built-in names of ``kind`` followed by those installed packages declare."""
    builtins = list(builtins)
    return builtins + sorted(n for n in entry_points(kind) if n not in builtins)


def _import(path: str, kind: str, name: str) -> Any:
    module, _, attr = path.partition(":")
    if path in _registered:
        return _registered[path]
    try:
        obj: Any = importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = e.name or module
        raise ProtoflError(f"{kind} {name!r}: module {missing!r} is not installed (pip install "
                           f"the package that provides it)") from None
    except Exception as e:  # noqa: BLE001 - the plugin's own import error, in one line
        raise ProtoflError(f"{kind} {name!r}: importing {module!r} failed: "
                           f"{type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ProtoflError(f"{kind} {name!r}: module {module!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def load(kind: str, name: str, builtins: dict[str, str]) -> Any:
    """The object ``name`` stands for: a built-in (``builtins``: name -> import path), an
    installed entry point of ``kind``, or an import path. One line when there is none."""
    if name in builtins:
        return _import(builtins[name], kind, name)
    eps = entry_points(kind)
    if name in eps:
        dist = eps[name].dist.name if eps[name].dist else "?"
        try:
            return eps[name].load()
        except Exception as e:  # noqa: BLE001 - a broken plugin, in one line
            raise ProtoflError(f"{kind} {name!r} (entry point of {dist}) failed to load: "
                               f"{type(e).__name__}: {e}") from None
    if is_path(name):
        return _import(name, kind, name)
    allowed = ", ".join(names(kind, builtins))
    raise ProtoflError(f"unknown {kind} {name!r}; allowed: {allowed}, or an import path "
                       f"package.module:Name")


def _distribution(module: str) -> metadata.Distribution | None:
    """The installed distribution that provides top-level package ``module``, if any."""
    top = module.split(".")[0]
    dists = metadata.packages_distributions().get(top, [])
    for dist in dists:
        try:
            return metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def origin(kind: str, name: str, builtins: dict[str, str]) -> dict[str, Any] | None:
    """Where plugin ``name`` comes from, for ``config.json``: its import path and the
    distribution and version providing it (None for a built-in)."""
    if name in builtins:
        return None
    eps = entry_points(kind)
    if name in eps:
        ep = eps[name]
        dist = ep.dist
        return {"kind": kind, "path": ep.value, "entry_point": name,
                "distribution": dist.name if dist else None,
                "version": dist.version if dist else None}
    obj = load(kind, name, builtins)
    module = getattr(obj, "__module__", None) or name.partition(":")[0]
    dist = _distribution(module)
    return {"kind": kind, "path": name, "entry_point": None,
            "distribution": dist.metadata["Name"] if dist else None,
            "version": dist.version if dist else None}


def check(recorded: dict[str, dict[str, Any]], installed_only: bool = False) -> None:
    """Refuse, with one line naming the package, to go on with a run whose recorded plugins
    are missing or installed at another version. ``installed_only`` (a Flower site): also
    refuse a plugin that no installed distribution provides (code the server merely names)."""
    for key, rec in recorded.items():
        if not isinstance(rec, dict) or not isinstance(rec.get("path"), str):
            raise ProtoflError(f"config: plugins.{key} = {rec!r} is not what protofl wrote "
                               "(a mapping with the plugin's path, package and version)")
        dist, version, path = rec.get("distribution"), rec.get("version"), rec["path"]
        where = f"{key} = {rec.get('entry_point') or path!r}"
        if dist is None and path in _registered and not installed_only:
            continue
        if dist is None:
            if installed_only:
                raise ProtoflError(f"{where} comes from no installed package; this node runs "
                                   "only plugins installed on it")
            module = path.partition(":")[0]
            if module == "__main__" or (module not in sys.modules
                                        and importlib.util.find_spec(module.split(".")[0])
                                        is None):
                raise ProtoflError(f"{where}: module {module!r} cannot be imported here "
                                   "(a class defined in a script or notebook is found only "
                                   "by the process that defined it)")
            continue
        try:
            have = metadata.version(dist)
        except metadata.PackageNotFoundError:
            raise ProtoflError(f"{where} needs package {dist} {version}, which is not "
                               f"installed (pip install '{dist}=={version}')") from None
        if have != version:
            raise ProtoflError(f"{where} was recorded with {dist} {version}, but {dist} "
                               f"{have} is installed (pip install '{dist}=={version}', or "
                               "start a new run)")


def describe(obj: Any) -> str:
    """A plugin's one-line description: its ``description`` attribute, else the first line
    of its docstring."""
    text = getattr(obj, "description", "") or inspect.getdoc(obj) or ""
    return text.strip().splitlines()[0] if text.strip() else ""
