"""A run folder: config.json, metrics.jsonl, summary.json, checkpoint.safetensors, plots.

:class:`RunStore` owns a run folder: it is the one object that writes into it (the lock, the
resolved config, the metric lines, checkpoints, per-round weights, figures, the summary, the
JSON side files of statistics and trackers, the Flower server's log) and the one that reads a
run back (config, records, summary, checkpoint, resume checks). The round loop calls it at the
start, every round, at checkpoints and at the end; the Flower ServerApp uses the same object;
reports and trackers read and write through it. The functions below are its parts.

- Writes are atomic (a temporary file, then a rename), so a killed run never leaves a torn file;
  ``metrics.jsonl`` is appended line by line, and a torn last line (a kill mid-write) is dropped
  with a warning when it is read.
- One writer at a time: ``lock(out)`` holds an exclusive ``flock`` on ``out/.protofl.lock``
  (holder's pid and host written in it). The kernel drops the lock when its process dies, so a
  lock file left by a dead process is simply taken over.
- Checkpoints are safetensors plus JSON (``tensorfile``): loading one never runs code.
- ``plan.jsonl`` holds the trainer of every round and the hash and cost table of the
  calibration ``trainer: auto`` read (``engine/calibrate.py``), a line a round; ``--resume``
  and ``trainer_plan`` replay it (:func:`read_plan`).
- ``manifest.json`` (``engine/manifest.py``) holds the SHA-256 of the config, the checkpoint,
  the metric and plan lines up to it, the summary and the round weights, and the settings changed on
  resume; :meth:`RunStore.verify` checks a folder against it before it is resumed or read.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch

from protofl.engine import manifest as mf
from protofl.engine import tensorfile
from protofl.errors import ProtoflError

log = logging.getLogger("protofl")

CONFIG, METRICS, SUMMARY = "config.json", "metrics.jsonl", "summary.json"
CHECKPOINT = "checkpoint.safetensors"
PLAN = "plan.jsonl"  # the trainer of every round and the calibration it read
LEGACY_CHECKPOINT = "checkpoint.pt"  # written by protofl <= 0.1 with torch.save (pickle)
LOCK = ".protofl.lock"
WEIGHTS_DIR = "weights"  # per-round aggregate weights (metrics.save_weights), FFD's reference
# Every file protofl writes into a run folder; ``--overwrite`` removes these and nothing else.
ARTEFACTS = (CONFIG, METRICS, SUMMARY, CHECKPOINT, LEGACY_CHECKPOINT, "curves.png",
             "confusion.png", "tsne.png", "segmentation.png", "flower.log", "stats.json",
             "stats.png", "tracking.json", PLAN, mf.MANIFEST)
# Settings a resumed run cannot change: they define its federation, its model or its privacy
# accounting (``data.root`` may move: the same files elsewhere).
FIXED_ON_RESUME = ("algorithm", "task", "seed", "data.", "model.", "privacy.")
MOVABLE_ON_RESUME = ("data.root",)


def json_safe(obj: Any) -> Any:
    """JSON-safe: NaN/Inf become null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def atomic_write(path: Path, data: bytes, before: Callable[[], None] | None = None) -> None:
    """Write ``path`` whole or not at all: a failed write (a full disk) leaves the file as it
    was, and is one ProtoflError line. ``before`` runs once the data are on disk and before
    they replace ``path`` (the manifest recording them)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if before is not None:
            before()
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        was = "is kept as it was" if path.exists() else "was not written"
        raise ProtoflError(f"cannot write {path}: {e.strerror or e}; {path.name} {was}") from None
    except ProtoflError:
        tmp.unlink(missing_ok=True)
        raise


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(json_safe(obj), indent=2) + "\n").encode()


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, json_bytes(obj))


# ---- one writer per folder ----
_held: dict[Path, tuple[int, int]] = {}  # folder -> (lock fd, nesting depth) in this process


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}


@contextmanager
def lock(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on run folder ``out`` (created if missing) for the block.

    A second writer, in this or another process on a local file system, gets a ProtoflError
    naming the holder. Re-entrant within one process. (``flock`` on NFS may not be exclusive
    across hosts.)"""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        key = out.resolve()
    except OSError as e:
        raise ProtoflError(f"cannot create run folder {out}: {e.strerror}") from None
    if key in _held:
        fd, depth = _held[key]
        _held[key] = (fd, depth + 1)
        try:
            yield
        finally:
            fd, depth = _held[key]
            _held[key] = (fd, depth - 1)
        return
    try:
        fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ProtoflError(f"cannot lock run folder {out}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        h = _holder(fd)
        os.close(fd)
        who = f"pid {h.get('pid', '?')} on {h.get('host', '?')}" if h else "another process"
        raise ProtoflError(f"run folder {out} is in use by {who}; wait for that run to end "
                           "(or stop it), or choose another --out") from None
    old = _holder(fd)
    if old.get("pid") and old.get("host") == socket.gethostname() and not _alive(old["pid"]):
        log.warning("run folder %s: taking over the lock of pid %s, which is no longer running",
                    out, old["pid"])
    me = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
    os.ftruncate(fd, 0)
    os.pwrite(fd, me.encode(), 0)
    _held[key] = (fd, 1)
    try:
        yield
    finally:
        del _held[key]
        os.ftruncate(fd, 0)  # the file stays (unlinking it would race with a waiting opener)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def folder_state(out: Path) -> str:
    """What a run folder holds: "finished", "resumable" (a checkpoint) or "no-checkpoint"."""
    if (out / SUMMARY).exists():
        return "finished"
    if (out / CHECKPOINT).exists() or (out / LEGACY_CHECKPOINT).exists():
        return "resumable"
    return "no-checkpoint"


def prepare(out: Path, overwrite: bool) -> None:
    """Make ``out`` ready for a fresh run: create it, refuse one that already holds files
    unless ``overwrite`` (then remove the old run's artefacts), and a folder that holds other
    runs' folders either way. Checked before the lock is taken (a refused folder is left
    untouched, with no lock file) and again while holding it, so that no other run can start
    in between; if another process holds the lock, this refuses."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ProtoflError(f"--out {out} is a file, not a folder")
    if out.is_dir():
        _refuse_held(out, overwrite)
    with lock(out):
        if _refuse_held(out, overwrite):
            clear(out)


def _refuse_held(out: Path, overwrite: bool) -> bool:
    """Whether ``out`` holds files (to clear with ``overwrite``); one line refusing it when
    it holds a run and not ``overwrite``, or holds other runs' folders."""
    files = sorted(p.name for p in out.iterdir() if p.name != LOCK)
    if not files:
        return False
    if not (out / CONFIG).exists():
        runs = sorted({c.relative_to(out).parts[0] for pattern in (f"*/{CONFIG}",
                                                                  f"*/*/{CONFIG}")
                       for c in out.glob(pattern)})  # two levels: never a walk of $HOME
        if runs:
            shown = ", ".join(runs[:3]) + (", ..." if len(runs) > 3 else "")
            raise ProtoflError(f"--out {out} is a folder of runs ({shown}), not a run folder: "
                               f"give a new folder for this run, e.g. --out {out / 'NAME'}")
    if overwrite:
        return True
    if not (out / CONFIG).exists() and folder_state(out) == "no-checkpoint":
        shown = ", ".join(files[:3]) + (", ..." if len(files) > 3 else "")
        raise ProtoflError(f"--out {out} already holds files that are not a run ({shown}): "
                           "choose an empty or new folder (--overwrite removes only the files "
                           "protofl writes)")
    how = {"finished": "use --overwrite to replace it, or another --out",
           "resumable": "use --resume to continue it, --overwrite to replace it, or "
                        "another --out",
           "no-checkpoint": "it was stopped before its first checkpoint, so there is "
                            "nothing to resume: use --overwrite to start it again, or "
                            "another --out"}[folder_state(out)]
    raise ProtoflError(f"run folder {out} already holds a run; {how}")


def clear(out: Path) -> list[str]:
    """Remove the files protofl writes in a run folder (and their ``.tmp`` twins); others stay.
    Returns the names removed."""
    gone = []
    for name in ARTEFACTS:
        for p in (out / name, out / (name + ".tmp")):
            if p.is_file() or p.is_symlink():
                p.unlink()
                gone.append(p.name)
    return gone


# ---- metrics ----
class Metrics(NamedTuple):
    rows: list[dict]
    torn: str | None  # the dropped torn last line, if any


def append_metrics(out: Path, record: dict) -> bytes:
    """One line more in ``metrics.jsonl`` (returned); a failed write (a full disk) is one
    ProtoflError line, and what the line tore is dropped when the file is read."""
    line = (json.dumps(json_safe(record)) + "\n").encode()
    try:
        with open(out / METRICS, "ab") as f:
            f.write(line)
            f.flush()
    except OSError as e:
        raise ProtoflError(f"cannot append round {record.get('round')} to {out / METRICS}: "
                           f"{e.strerror or e}; the rounds before it are kept") from None
    return line


def read_metrics_checked(folder: Path) -> Metrics:
    """The rows of ``metrics.jsonl``. A last line with no newline that is not valid JSON was
    torn by a kill mid-write: it is returned in ``torn``, not in ``rows``. Any other bad line
    is a ProtoflError."""
    path = Path(folder) / METRICS
    if not path.exists():
        raise ProtoflError(f"{folder} is not a run folder (no {METRICS})")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ProtoflError(f"{path} cannot be read: {type(e).__name__}") from None
    lines = text.split("\n")  # the last item is "" when the file ends with a newline
    rows, torn = [], None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):  # no newline after it: a torn append
                torn = line
                break
            raise ProtoflError(f"{path}:{i} is not valid JSON") from None
        if not isinstance(row, dict) or not isinstance(row.get("round"), int):
            raise ProtoflError(f"{path}:{i} is not a metrics record (no integer 'round')")
        rows.append(row)
    return Metrics(rows, torn)


def read_metrics(folder: Path) -> list[dict]:
    """The rows of ``metrics.jsonl``; a torn last line is dropped with a warning."""
    rows, torn = read_metrics_checked(folder)
    if torn is not None:
        log.warning("%s: dropped a torn last line (the run was killed while writing it): %.60s",
                    Path(folder) / METRICS, torn)
    return rows


def truncate_metrics(out: Path, last_round: int) -> bytes:
    """Drop metric lines past the checkpoint (they are recomputed on resume), and a torn last
    line (which ``check_history`` has reported); the file is rewritten atomically, the lines
    kept byte for byte. Returns what it holds."""
    path = out / METRICS
    if not path.exists():
        return b""
    rows = read_metrics_checked(out).rows  # one per non-blank line, a torn last one left out
    lines = [line for line in path.read_text().split("\n") if line.strip()]
    data = "".join(line + "\n" for line, row in zip(lines, rows)
                   if row["round"] <= last_round).encode()
    atomic_write(path, data)
    return data


def evaluated_rounds(upto: int, eval_every: int, total: int) -> list[int]:
    """The rounds ``1..upto`` that write a metrics line: every ``eval_every``-th and the last."""
    return [t for t in range(1, upto + 1) if t % eval_every == 0 or t == total]


def check_history(out: Path, checkpoint_round: int, eval_every: int, total: int) -> list[dict]:
    """Refuse to resume from a checkpoint at ``checkpoint_round`` when ``metrics.jsonl`` lacks
    any round up to it (deleted, or cut short): the resumed run would silently miss history.
    Nothing is rebuilt (that would mean re-running those rounds: start again instead).
    Returns the rows."""
    path = Path(out) / METRICS
    need = evaluated_rounds(checkpoint_round, eval_every, total)
    if not path.exists():
        if not need:
            return []
        raise ProtoflError(f"{out}: {METRICS} is missing but the checkpoint is at round "
                           f"{checkpoint_round}, so rounds 1-{checkpoint_round} would be lost; "
                           "restore the file, or start again with --overwrite")
    rows = read_metrics(out)
    have = {r["round"] for r in rows}
    missing = [t for t in need if t not in have]
    if missing:
        raise ProtoflError(f"{path} lacks round {missing[0]} (of {len(missing)} missing up to "
                           f"the checkpoint at round {checkpoint_round}); restore the file, or "
                           "start again with --overwrite")
    return rows


# ---- checkpoints ----
def should_checkpoint(round: int, every: int, last: int) -> bool:
    """Whether round ``round`` writes a checkpoint: every ``every``-th round and always the last
    one (``every == 0``: only the last)."""
    return round == last or (every > 0 and round % every == 0)


def save_checkpoint(out: Path, payload: dict) -> None:
    """Write ``payload`` (nested dicts/lists/tuples of tensors, ints, floats, bools, strings,
    None) atomically as ``checkpoint.safetensors``; a pre-0.2 ``checkpoint.pt`` goes."""
    atomic_write(out / CHECKPOINT, tensorfile.encode(payload))
    (out / LEGACY_CHECKPOINT).unlink(missing_ok=True)


def load_checkpoint(out: Path) -> dict:
    """The payload ``save_checkpoint`` wrote. A ``checkpoint.pt`` of protofl <= 0.1 is read
    with ``torch.load(weights_only=True)``, which refuses pickled code."""
    path = out / CHECKPOINT
    if path.exists():
        try:
            payload = tensorfile.decode(path.read_bytes())
        except (OSError, ValueError) as e:
            raise ProtoflError(f"{path} cannot be read: {e}") from None
    elif (out / LEGACY_CHECKPOINT).exists():
        path = out / LEGACY_CHECKPOINT
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # a torn file, or one with pickled code the safe loader refuses
            raise ProtoflError(f"{path} cannot be read safely: {type(e).__name__}") from None
    else:
        raise ProtoflError(f"{out} has no checkpoint to resume from (the run was stopped before "
                           "its first one); start it again with --overwrite")
    if not isinstance(payload, dict):
        raise ProtoflError(f"{path} does not hold a protofl checkpoint")
    return payload


def check_resumable(out: Path, snap: dict, algorithm: str, state: dict) -> None:
    """Refuse, before any round, a checkpoint that is not the configured run's: written by
    another algorithm, or (checkpoints without the name) a state that lacks an entry of
    ``state`` (the configured run's fresh one) or holds a tensor of another shape."""
    saved = snap.get("algorithm")
    if saved is not None and saved != algorithm:
        raise ProtoflError(f"{out}: its checkpoint is a {saved} run's but config.json "
                           f"configures {algorithm}; it cannot be resumed as it is")
    if not isinstance(snap.get("state"), dict) or not isinstance(snap.get("round"), int):
        raise ProtoflError(f"{out / CHECKPOINT} does not hold a protofl checkpoint")
    want, have = _shapes(state), _shapes(snap["state"])
    key = [k for k in want if k not in have or (isinstance(want[k], tuple)
                                                and isinstance(have[k], tuple)
                                                and want[k] != have[k])]
    if key:
        raise ProtoflError(f"{out}: its checkpoint does not match config.json's {algorithm} "
                           f"run (state entry {key[0]!r} differs); it cannot be resumed")


def _shapes(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a nested state: tensors by shape, other values by type."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_shapes(v, f"{prefix}{k}."))
        return out
    if isinstance(tree, torch.Tensor):
        return {prefix[:-1]: tuple(tree.shape)}
    return {prefix[:-1]: type(tree).__name__}


def load_config_json(out: Path) -> dict:
    path = out / CONFIG
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        raise ProtoflError(f"{out} has no readable {CONFIG}") from None
    if not isinstance(cfg, dict):
        raise ProtoflError(f"{path} does not hold a config object")
    return cfg


def plan_lines(round: int, trainer: str, calibration: str | None,
               table: dict | None, last: str | None) -> bytes:
    """A round's lines of ``plan.jsonl``: the calibration's table when it is new (``last``:
    the calibration of the line before), then the round's trainer."""
    lines = []
    if calibration is not None and calibration != last:
        lines.append({"calibration": calibration, "costs": table})
    lines.append({"round": round, "trainer": trainer, "calibration": calibration})
    return "".join(json.dumps(json_safe(x)) + "\n" for x in lines).encode()


def read_plan(folder: Path, upto: int | None = None) -> Any:
    """The :class:`trainers.Plan` a run folder recorded (rounds past ``upto`` left out); one
    line when the folder or its ``plan.jsonl`` is not one."""
    import math as _math

    from protofl.engine.trainers import Plan

    path = Path(folder) / PLAN
    if not Path(folder).is_dir():
        raise ProtoflError(f"trainer_plan: {folder} is not a run folder")
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise ProtoflError(f"trainer_plan: {folder} has no {PLAN} (a run folder of protofl "
                           "0.2 or later records one)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ProtoflError(f"trainer_plan: {path} cannot be read: {type(e).__name__}") from None
    plan, tables = Plan(), {}
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if "costs" in row:
                costs = row["costs"]
                tables[str(row["calibration"])] = {
                    k: (_math.inf if v is None else float(v)) for k, v in costs.items()}
                continue
            t, name, cal = int(row["round"]), str(row["trainer"]), row.get("calibration")
        except (ValueError, TypeError, KeyError, AttributeError):
            if i == len(lines) and not path.read_bytes().endswith(b"\n"):
                break  # torn by a kill mid-write
            raise ProtoflError(f"trainer_plan: {path}:{i} is not a plan line") from None
        if upto is not None and t > upto:
            continue
        if cal is not None and cal not in tables:
            raise ProtoflError(f"trainer_plan: {path}:{i} names calibration {cal} whose costs "
                               "it does not hold")
        plan.rounds[t] = name
        if cal is not None:
            plan.calibration, plan.table = cal, tables[cal]
    return plan


def weights_path(folder: Path, round: int) -> Path:
    return Path(folder) / WEIGHTS_DIR / f"round_{round:04d}.safetensors"


def _weights_round(name: str) -> int:
    """The round of a weights file's name (``weights/round_0007.safetensors`` -> 7)."""
    return int(name.rsplit("round_", 1)[1].split(".")[0])


def encode_weights(weights: dict) -> bytes:
    """``weights`` (``{"params": ..., "buffers": ...}``, copied to the CPU) as safetensors."""
    return tensorfile.encode({part: {k: v.detach().cpu().contiguous()
                                     for k, v in weights[part].items()}
                              for part in ("params", "buffers")})


class RunStore:
    """The owner of run folder ``out``: every write into it, and every read of a run back.

    The round loop's calls, in order: :meth:`start` (a fresh run: prepare the folder and write
    ``config.json``; a resumed one: drop metric lines past its checkpoint), :meth:`round_end`
    (the metric line of an evaluated round, the checkpoint when due, the round's weights) and
    :meth:`finish` (``summary.json``). :meth:`resume` checks a folder before a checkpoint is
    continued. Figures, statistics and trackers write through :meth:`save_figure`,
    :meth:`write_json` and :meth:`place`; the Flower ServerApp's log through
    :meth:`log_handler`. ``overwrite`` lets a fresh run replace the folder's old run.

    Every file a resumed run or a report trusts is recorded in ``manifest.json``
    (``engine/manifest.py``) as it is written; :meth:`verify` checks the folder against it.
    """

    def __init__(self, out: str | Path, overwrite: bool = False):
        self.out, self.overwrite = Path(out), overwrite
        self.saved: int | None = None  # the round of the folder's checkpoint, if any
        self._manifest: dict | None = None  # what this store has written (loaded when needed)
        self._metrics: Any = None  # the running SHA-256 of metrics.jsonl and its length
        self._metrics_bytes = 0
        self._plan: Any = None  # the same of plan.jsonl, and the calibration of its last line
        self._plan_bytes = 0
        self._plan_cal: str | None = None
        self.replay: Any = None  # a resumed run's recorded plan (read_plan), every round

    def __repr__(self) -> str:
        return f"RunStore({str(self.out)!r})"

    # ---- the folder as a whole ----
    def lock(self):
        """Hold the folder's lock for a block (``lock``)."""
        return lock(self.out)

    def held(self) -> set[str]:
        """The names of what the folder holds (the lock file left out)."""
        return {p.name for p in self.out.iterdir()} - {LOCK} if self.out.is_dir() else set()

    def folder_state(self) -> str:
        return folder_state(self.out)

    def is_run(self) -> bool:
        return (self.out / CONFIG).is_file()

    def check_fresh(self) -> None:
        """Refuse, before anything is built or locked, a folder a fresh run cannot use (it
        holds a run and not ``overwrite``, or other runs' folders); :meth:`start` checks again
        under the lock."""
        if self.out.exists() and not self.out.is_dir():
            raise ProtoflError(f"--out {self.out} is a file, not a folder")
        if self.out.is_dir():
            _refuse_held(self.out, self.overwrite)

    # ---- integrity ----
    def manifest(self) -> dict | None:
        """The folder's manifest (None: a folder written before manifests)."""
        return mf.read(self.out)

    def problems(self) -> list[str]:
        """What in the folder differs from its manifest, one line each; a folder without one
        has nothing to check (``manifest()`` is None)."""
        manifest = self.manifest()
        return [] if manifest is None else mf.problems(self.out, manifest)

    def verify(self) -> dict | None:
        """Refuse, in one line naming the file and what differs, a folder whose config,
        checkpoint, metric lines, summary or round weights changed after protofl wrote them;
        the manifest, or None for a folder written before manifests (nothing to check)."""
        manifest = self.manifest()
        found = [] if manifest is None else mf.problems(self.out, manifest)
        if found:
            more = (f" (and {len(found) - 1} more: `protofl verify {self.out}`)"
                    if len(found) > 1 else "")
            raise ProtoflError(f"{self.out}: {found[0]}{more}")
        return manifest

    def _open(self) -> dict:
        """This store's manifest, read from the folder the first time (a new one if none),
        with the running digest of ``metrics.jsonl`` as it stands."""
        if self._manifest is None:
            self._manifest = mf.read(self.out) or mf.new()
        if self._metrics is None:
            path = self.out / METRICS
            self._seal_metrics(path.read_bytes() if path.exists() else b"")
        return self._manifest

    def _seal_metrics(self, data: bytes) -> None:
        self._metrics, self._metrics_bytes = hashlib.sha256(data), len(data)

    def _seal_plan(self, data: bytes, calibration: str | None = None) -> None:
        self._plan, self._plan_bytes = hashlib.sha256(data), len(data)
        self._plan_cal = calibration

    def _plan_entry(self, round: int) -> dict[str, dict | None]:
        """The manifest's entry of ``plan.jsonl`` (None: the run wrote none)."""
        if self._plan is None or not self._plan_bytes:
            return {PLAN: None}
        return {PLAN: {"sha256": self._plan.hexdigest(), "bytes": self._plan_bytes,
                       "round": round, "prefix": True}}

    def _metrics_entry(self, round: int) -> dict:
        return {"sha256": self._metrics.hexdigest(), "bytes": self._metrics_bytes,
                "round": round, "prefix": True}

    def _record(self, entries: dict[str, dict | None]) -> Callable[[], None]:
        """A write of the manifest with ``entries`` (None: removed), for ``atomic_write``'s
        ``before``: the manifest names a file's new content before it is renamed into place."""
        def write() -> None:
            files = self._open()["files"]
            for name, entry in entries.items():
                if entry is None:
                    files.pop(name, None)
                else:
                    files[name] = entry
            atomic_write(self.out / mf.MANIFEST, mf.encode(self._manifest))
        return write

    def _config_entry(self, data: bytes) -> dict:
        return {**mf.digest(data), "settings": json.loads(data)}

    # ---- reading a run back ----
    def config(self) -> dict:
        return load_config_json(self.out)

    def records(self) -> list[dict]:
        return read_metrics(self.out)

    def summary(self) -> dict | None:
        path = self.out / SUMMARY
        return json.loads(path.read_text()) if path.exists() else None

    def checkpoint(self) -> dict:
        return load_checkpoint(self.out)

    def read_json(self, name: str) -> dict | None:
        path = self.out / name
        return json.loads(path.read_text()) if path.exists() else None

    def weights_path(self, round: int) -> Path:
        return weights_path(self.out, round)

    # ---- the round loop's calls ----
    def start(self, spec: dict, round: int) -> None:
        """Before the first round: a fresh run (``round`` 0) prepares the folder (refusing one
        that holds a run unless ``overwrite``), writes ``config.json`` and removes the round
        weights a replaced run left; a resumed run drops the metric lines past its checkpoint."""
        if round:
            self.saved = round
            self._reseal(round)
            return
        prepare(self.out, self.overwrite)
        self._manifest = mf.new()
        self._seal_metrics(b"")
        self._seal_plan(b"")
        data = json_bytes(spec)
        atomic_write(self.out / CONFIG, data, self._record({CONFIG: self._config_entry(data)}))
        for p in (self.out / WEIGHTS_DIR).glob("round_*"):
            p.unlink()

    def _reseal(self, round: int) -> None:
        """A resumed run's manifest: the metric lines past its checkpoint of ``round`` dropped,
        and the files as they are now (checked by :meth:`verify` first; a folder written
        before manifests gets its first one here)."""
        self._seal_metrics(truncate_metrics(self.out, round))
        self._reseal_plan(round)
        manifest = self._open()
        config = (self.out / CONFIG).read_bytes()
        entries: dict[str, dict | None] = {
            CONFIG: self._config_entry(config),
            CHECKPOINT: ({**mf.file_digest(self.out / CHECKPOINT), "round": round}
                         if (self.out / CHECKPOINT).exists() else None),
            METRICS: self._metrics_entry(round), **self._plan_entry(round)}
        for name in manifest["files"]:  # round weights past the checkpoint are made again
            if name.startswith(WEIGHTS_DIR + "/") and _weights_round(name) > round:
                entries[name] = None
        self._record(entries)()

    def _reseal_plan(self, round: int) -> None:
        """A resumed run's ``plan.jsonl``: the whole recorded plan kept in ``replay`` (the
        rounds a killed run trained past its checkpoint included), the file cut back to the
        checkpoint's round (rewritten atomically)."""
        path = self.out / PLAN
        if not path.exists():
            self._seal_plan(b"")
            return
        self.replay = read_plan(self.out)
        keep, cal = [], None
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                break  # a torn last line
            if "round" in row and row["round"] > round:
                continue
            keep.append(line + "\n")
            cal = row.get("calibration", cal)
        data = "".join(keep).encode()
        atomic_write(path, data)
        self._seal_plan(data, cal)

    def resume(self, spec: dict, round: int, eval_every: int, rounds: int) -> None:
        """Before a checkpoint of round ``round`` is continued: ``metrics.jsonl`` must hold
        every evaluated round up to it. Settings of ``spec`` that differ from ``config.json``
        (``rounds`` extended or cut, another device, ``--set``) are recorded in the manifest's
        history and ``config.json`` is rewritten; those of ``FIXED_ON_RESUME`` are refused."""
        check_history(self.out, round, eval_every, rounds)
        data = json_bytes(spec)
        changes = mf.setting_changes(load_config_json(self.out), json.loads(data))
        fixed = [k for k in changes if k.startswith(FIXED_ON_RESUME)
                 and k not in MOVABLE_ON_RESUME]
        if fixed:
            old, new = changes[fixed[0]]
            raise ProtoflError(f"{self.out}: {fixed[0]} cannot change on resume ({old!r} -> "
                               f"{new!r}): it defines the run's federation, model or privacy "
                               "accounting; start a new run for it")
        if changes:
            self._open()["history"].append({"round": round, "changed": changes})
            atomic_write(self.out / CONFIG, data,
                         self._record({CONFIG: self._config_entry(data)}))
            log.info("%s: settings changed on resume after round %d: %s", self.out, round,
                     mf.said(changes, most=20))

    def round_end(self, record: dict, evaluated: bool, snapshot: Any = None,
                  weights: dict | None = None, trained: tuple | None = None) -> None:
        """After round ``record["round"]``: its plan line (``trained``: the trainer, the
        calibration's hash and table, ``trainers.last_choice``), its metric line when
        ``evaluated``, the checkpoint ``snapshot()`` when one is due (``snapshot`` is None
        otherwise), and ``weights`` (``metrics.save_weights``). A failed write (a full disk)
        says what the folder keeps."""
        t = record["round"]
        self._open()
        try:
            if trained is not None:
                self._append_plan(t, *trained)
            if evaluated:
                line = append_metrics(self.out, record)
                self._metrics.update(line)
                self._metrics_bytes += len(line)
            if snapshot is not None:
                data = tensorfile.encode(snapshot())
                last = self._manifest["files"].get(CHECKPOINT)
                entry = {**mf.digest(data), "round": t,
                         **({"previous": {k: v for k, v in last.items() if k != "previous"}}
                            if last else {})}
                atomic_write(self.out / CHECKPOINT, data, self._record(
                    {CHECKPOINT: entry, METRICS: self._metrics_entry(t),
                     **self._plan_entry(t)}))
                (self.out / LEGACY_CHECKPOINT).unlink(missing_ok=True)
                self.saved = t
        except ProtoflError as e:
            kept = (f"its checkpoint of round {self.saved} is intact: free space, then "
                    f"`protofl run --resume {self.out}`" if self.saved else
                    "it has no checkpoint yet")
            raise ProtoflError(f"{e}; the run stopped, {kept}") from None
        if weights is not None:  # recorded with the next checkpoint or the summary
            path = weights_path(self.out, t)
            path.parent.mkdir(parents=True, exist_ok=True)
            data = encode_weights(weights)
            atomic_write(path, data)
            self._manifest["files"][f"{WEIGHTS_DIR}/{path.name}"] = mf.digest(data)

    def finish(self, summary: dict) -> None:
        """``summary.json``, recorded in the manifest with every metric line."""
        self._open()
        data = json_bytes(summary)
        rounds = summary.get("rounds", 0)
        atomic_write(self.out / SUMMARY, data, self._record(
            {SUMMARY: mf.digest(data), METRICS: self._metrics_entry(rounds),
             **self._plan_entry(rounds)}))

    def _append_plan(self, round: int, trainer: str, calibration: str | None,
                     table: dict | None) -> None:
        if self._plan is None:
            path = self.out / PLAN
            self._seal_plan(path.read_bytes() if path.exists() else b"")
        data = plan_lines(round, trainer, calibration, table, self._plan_cal)
        try:
            with open(self.out / PLAN, "ab") as f:
                f.write(data)
                f.flush()
        except OSError as e:
            raise ProtoflError(f"cannot append round {round} to {self.out / PLAN}: "
                               f"{e.strerror or e}") from None
        self._plan.update(data)
        self._plan_bytes += len(data)
        self._plan_cal = calibration

    # ---- what others write through it ----
    def write_json(self, name: str, obj: Any) -> Path:
        """``name`` (a side file: ``stats.json``, ``tracking.json``), atomically."""
        self.out.mkdir(parents=True, exist_ok=True)
        write_json(self.out / name, obj)
        return self.out / name

    def save_figure(self, name: str, fig: Any, dpi: int = 100) -> Path:
        """A matplotlib figure as ``name`` (a PNG), atomically."""
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi)
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write(self.out / name, buf.getvalue())
        return self.out / name

    def place(self, name: str, clear: str | None = None) -> Path:
        """The subfolder ``name`` lent to a writer the store cannot drive itself (TensorBoard's
        event files), created; ``clear``: a glob of files a replaced run left there, removed."""
        path = self.out / name
        path.mkdir(parents=True, exist_ok=True)
        if clear:
            for stale in path.glob(clear):
                stale.unlink()
        return path

    def log_handler(self, name: str) -> logging.Handler:
        """A logging handler appending to ``name`` (opened at its first line)."""
        handler = logging.FileHandler(self.out / name, delay=True)
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s %(message)s"))
        return handler


def verify_folders(paths: list[Path]) -> tuple[list[str], int]:
    """``protofl verify``: one line per run folder under ``paths`` (ok, each file that
    differs, or not checked) and each setting changed on resume; the exit code: 2 if a file
    differs, 1 if a folder has no manifest, else 0."""
    folders: list[Path] = []
    for p in map(Path, paths):
        found = [p] if (p / CONFIG).is_file() else sorted(
            c.parent for c in p.rglob(CONFIG)) if p.is_dir() else []
        if not found:
            raise ProtoflError(f"{p} is not a run folder (no {CONFIG}) or a folder of runs")
        folders += found
    lines, bad, unchecked = [], 0, 0
    for folder in folders:
        try:
            manifest = mf.read(folder)
        except ProtoflError as e:
            bad += 1
            lines.append(str(e))
            continue
        if manifest is None:
            unchecked += 1
            lines.append(f"{folder}: not checked: no {mf.MANIFEST} (written by protofl 0.1)")
            continue
        found = mf.problems(folder, manifest)
        bad += bool(found)
        saved = manifest["files"].get(CHECKPOINT, {}).get("round")
        lines += [f"{folder}: {line}" for line in found] or [
            f"{folder}: ok ({len(manifest['files'])} files match their SHA-256"
            + (f"; checkpoint of round {saved}" if saved is not None else "") + ")"]
        lines += [f"{folder}: settings changed on resume {line}"
                  for line in mf.history_lines(manifest)]
    return lines, 2 if bad else 1 if unchecked else 0
