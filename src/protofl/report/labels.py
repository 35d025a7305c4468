"""Words for tables: readable row labels from the config keys that vary, column names, and
the one-line description of a table's setting."""

from __future__ import annotations

from collections import Counter
from typing import Any

# (flattened config key, value) -> words; anything else falls back to ``key=value``
WORDS: dict[tuple[str, Any], str] = {
    ("algo.weights", "fedavg"): "FedAvg weights",
    ("algo.weights", "fair"): "equal weights (fairness)",
    ("algo.weights", "attention"): "margin attention weights",
    ("clients.sampling", "weighted"): "weighted sampling",
    ("clients.sampling", "uniform"): "uniform (i.i.d.) sampling",
    ("clients.tolerate_partial", True): "partial work tolerated",
    ("clients.tolerate_partial", False): "stragglers dropped",
    ("algo.score", "dplus"): "d⁺ only",
    ("algo.score", "margin"): "full margin score",
    ("algo.clues", "lpm"): "LPM only",
    ("algo.clues", "apm"): "APM only",
    ("algo.clues", "both"): "LPM and APM",
    ("algo.reduce", "mean"): "mean over classes",
    ("algo.reduce", "sum"): "sum over classes",
    ("algo.combine", "product"): "LPM × APM",
    ("algo.combine", "sum"): "LPM + APM",
    ("algo.normalize", "channel"): "per-channel normalisation",
    ("algo.normalize", "class"): "per-class normalisation",
    ("algo.distance", "cosine"): "cosine distance",
    ("algo.distance", "euclidean"): "Euclidean distance",
    ("algo.flips", False): "no flips",
    ("algo.flips", True): "flips",
}
KEY_WORDS = {"clients.lr": "lr", "clients.per_round": "per round", "clients.stragglers":
             "stragglers", "data.num_clients": "clients", "clients.local_steps": "local steps",
             "clients.local_epochs": "local epochs", "clients.batch_size": "batch",
             "clients.optimizer": "optimizer"}

# columns of the comparison table: summary key -> header (a column shows when a run has it)
COLUMNS = {"miou": "mIoU", "accuracy": "accuracy", "balanced_accuracy": "balanced accuracy",
           "f1_weighted": "weighted F1", "auc": "AUC", "local_miou": "local mIoU",
           "local_accuracy": "local accuracy", "client_accuracy_std": "client std",
           "client_accuracy_worst10": "worst 10% clients", "train_loss": "training loss",
           "dissimilarity": "gradient dissimilarity", "amm": "AMM", "seconds": "wall-clock s"}
# segmentation runs log their pixel accuracy under the keys every task logs
SEGMENTATION_HEADERS = {"accuracy": "pixel accuracy", "local_accuracy": "local pixel accuracy"}


def headers(columns: list[str], segmentation: bool) -> dict[str, str]:
    """The header of each column of a table (of segmentation runs, or not)."""
    names = {**COLUMNS, **(SEGMENTATION_HEADERS if segmentation else {})}
    return {c: names[c] for c in columns}

LEGEND = ("accuracy, balanced accuracy, weighted F1: the final aggregate model on the global "
          "test set (personalised methods: each client's own model on its own test split, "
          "pooled); local accuracy: the mean over clients of the accuracy on their own test "
          "split; training loss: cross-entropy of the aggregate model on a seeded sample of "
          "the training data; gradient dissimilarity: (1/|K|) Σ_k ‖∇L_k − ∇L‖² at the "
          "aggregate weights, estimated on seeded probe clients and their first rows unless "
          "metrics.dissimilarity_exact (every client, every row); AMM: "
          "aggregate mean margin of the clients' prototypes against the aggregate ones; "
          "wall-clock s: seconds the whole run spent in its rounds (local training, aggregation "
          "and the per-round evaluation), without loading data or building the model. "
          "Segmentation tables: mIoU: the mean over classes of the IoU from one confusion "
          "matrix of every pixel of the global test set (void ignored; a class in neither "
          "truth nor prediction left out); pixel accuracy: correct non-void pixels; local "
          "mIoU and local pixel accuracy: means over clients of the figure on their own test "
          "split; training loss: the mean over images of their mean pixel cross-entropy.")

# keys that never explain a difference in results
IGNORED = {"seed", "checkpoint_every", "data.root", "metrics.eval_batch",
           "metrics.ffd_reference", "metrics.save_weights", "tracking", "tracking_dir"}
# keys that define the setting of a table (named in its caption; in row labels when they vary)
SETTING = ("data.num_clients", "clients.per_round", "rounds", "clients.local_steps",
           "clients.local_epochs", "clients.batch_size", "clients.optimizer", "clients.lr",
           "clients.stragglers")


def inert(flat: dict) -> set[str]:
    """Keys a run's config holds that cannot have changed its numbers: the local epochs when
    it counts local steps, the momentum of Adam (an algorithm's paper defaults fill both)."""
    out = set()
    if flat.get("clients.local_steps"):
        out.add("clients.local_epochs")
    if flat.get("clients.optimizer") == "adam":
        out.add("clients.momentum")
    return out


def words(key: str, value: Any) -> str:
    """Words for one option value: the table's words, else ``key=value``."""
    try:
        hit = WORDS.get((key, value))
    except TypeError:  # an unhashable value
        hit = None
    if hit:
        return hit
    name = KEY_WORDS.get(key, key.removeprefix("algo."))
    return f"{name}={value}"


def _key(v: Any) -> str:
    return repr(v)


def row_labels(algorithms: list[str], flats: list[dict], skip: set[str] = frozenset()
               ) -> tuple[list[str], dict[str, str]]:
    """Readable labels for runs shown in one table (``flats``: their flattened configs,
    ``{"clients.lr": 0.01, ...}``), and the baseline of each algorithm.

    A setting key (``SETTING``) that varies across the table is named in every label. Any
    other key counts when it varies among the runs of the same algorithm (an algorithm's own
    defaults never label it); its most common value there (the first seen on a tie) is the
    algorithm's baseline, said once in the caption, and a label names only where a run
    departs from it. Runs that differ only in seed get the same label, also when each
    seed draws its own partition (``data.seed`` = ``seed``, as in the suites)."""
    drop = IGNORED | set(skip)
    if all(f.get("data.seed") == f.get("seed") for f in flats):
        drop = drop | {"data.seed"}
    flats = [{k: v for k, v in f.items() if k not in inert(f)} for f in flats]
    keys = sorted({k for f in flats for k in f} - drop)
    table_varying = {k for k in keys if k in SETTING
                     and len({_key(f.get(k)) for f in flats}) > 1}
    baselines: dict[str, str] = {}
    by_alg: dict[str, list[int]] = {}
    for i, a in enumerate(algorithms):
        by_alg.setdefault(a, []).append(i)
    label_of: dict[int, str] = {}
    for alg, idx in by_alg.items():
        varying = [k for k in keys if k not in table_varying
                   and len({_key(flats[i].get(k)) for i in idx}) > 1]
        base = {}
        for k in varying:
            seen = [flats[i].get(k) for i in idx]
            counts = Counter(_key(v) for v in seen)
            top = max(counts.values())
            base[k] = next(v for v in seen if counts[_key(v)] == top)
        said = [words(k, v) for k, v in base.items() if v is not None]
        if said:
            baselines[alg] = ", ".join(said)
        for i in idx:
            f = flats[i]
            parts = [words(k, f.get(k)) for k in sorted(table_varying) if f.get(k) is not None]
            parts += [words(k, f.get(k)) for k in varying
                      if _key(f.get(k)) != _key(base[k]) and f.get(k) is not None]
            label_of[i] = ", ".join([alg, *parts])
    return [label_of[i] for i in range(len(algorithms))], baselines


def _one(values: list[Any], fmt=str) -> str:
    """One value, or every distinct value with ``/`` when they differ."""
    distinct = list(dict.fromkeys(_key(v) for v in values))
    if len(distinct) == 1:
        return fmt(values[0])
    seen: dict[str, Any] = {}
    for v in values:
        seen.setdefault(_key(v), v)
    return "/".join(fmt(v) for v in seen.values()) + " (differs between rows)"


def setting_caption(flats: list[dict], summaries: list[dict], clients: list[int | None]
                    ) -> str:
    """``30 clients, 10 per round, 60 rounds of 20 local steps (batch 10, sgd lr 0.01, 50%
    stragglers); seeds 0, 1, 2``: the setting of a table's runs."""
    f = flats

    def get(key):
        return [x.get(key) for x in f]

    def work(x: dict) -> str:
        if x.get("clients.local_steps"):
            return f"{x['clients.local_steps']} local steps"
        return f"{x.get('clients.local_epochs', 1)} local epoch(s)"

    n = _one([c if c is not None else "?" for c in clients])
    parts = [f"{n} clients, {_one(get('clients.per_round'))} per round",
             f"{_one([s.get('rounds') for s in summaries])} rounds of {_one([work(x) for x in f])}"
             f" (batch {_one(get('clients.batch_size'))}, {_one(get('clients.optimizer'))} "
             f"lr {_one(get('clients.lr'))}"]
    strag = get("clients.stragglers")
    if any(strag):
        parts[-1] += f", {_one(strag, lambda v: f'{100 * (v or 0):g}%')} stragglers"
    parts[-1] += ")"
    seeds = sorted({s.get("seed") for s in summaries if s.get("seed") is not None})
    return (", ".join(parts) + f"; seeds {', '.join(map(str, seeds))}; "
            "the final round, mean ± std over seeds")


def mix_note(rows: dict[str, list[dict]]) -> str:
    """What a caption must add when a table's rows are not alike: ``; the rows mix runs:
    fedavg: seed 0 (5 rounds), seed 1 (3 rounds); fedproto: seed 0 (5 rounds)`` when the runs
    differ in rounds, or each row's seeds when the rows have different seeds ('' else)."""
    every = [s for summaries in rows.values() for s in summaries]
    by_rounds = len({s.get("rounds") for s in every}) > 1
    seed_sets = {tuple(sorted(str(s.get("seed")) for s in ss)) for ss in rows.values()}
    if not by_rounds and len(seed_sets) <= 1:
        return ""
    parts = []
    for label, summaries in rows.items():
        runs = sorted(summaries, key=lambda s: str(s.get("seed")))
        if by_rounds:
            parts.append(f"{label}: " + ", ".join(f"seed {s.get('seed')} ({s.get('rounds')} "
                                                  "rounds)" for s in runs))
        else:
            parts.append(f"{label}: seed " + ", ".join(str(s.get("seed")) for s in runs))
    return "; the rows mix runs: " + "; ".join(parts)
