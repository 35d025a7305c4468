"""Sizes checked before memory is taken: no bad number reaches the allocator.

Before a model, a prototype table, a partition or a batch is allocated, the bytes it implies
(from the config and the data's header) are compared with the memory the machine has, and a
run that cannot fit stops with one line naming the key, its value and the bytes (exit code 2)
instead of a traceback from the allocator or a process that grows until it is killed.

Every estimate here is a *lower bound* of what is held at once (so a run is refused only when
it surely cannot fit): a :class:`Need` is one such allocation, ``check`` compares the needs of
one pool (host memory, or the memory of the run's CUDA device) with what is available there.

- the data layer checks what it allocates from a header or a count (a synthetic federation's
  clients, the per-client class counts) with ``check`` directly, and checks labels against the
  classes the data declares (``check_labels``) before any label sizes an array;
- ``run_needs`` gives what a resolved run needs from its algorithm built on the meta device
  (no memory): the model(s), the server state (prototype tables included), one client's
  training copy and optimizer state, a round's uploads, one client's batch schedule, a
  training and an evaluation batch, and the confusion matrix of its classes.
  ``engine/federation.build`` checks them (``engine.spec.check_sizes``) after resolving and
  before building, so the simulator and every Flower node refuse the same configs.

Available memory: host memory is ``$PROTOFL_MEMORY_MB`` if set (tests, or a share of a
machine), else ``MemAvailable`` (``/proc/meminfo``; what the cgroup's limit leaves when
lower; the physical memory where neither is readable); a CUDA device's is its free memory
(``device.memory_info``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from protofl import device as devices
from protofl.errors import ProtoflError

MEMORY_ENV = "PROTOFL_MEMORY_MB"
TENSOR_BYTES = 64  # at least this much per small tensor held in a list (object + storage)
CONFUSION_ENTRY = 24  # bytes per cell: int64 counts + the Python list and JSON of summary.json
FLOAT = 4  # float32 inputs, weights and logits
OVERFLOW = 2**63  # bytes of a size torch cannot count


@dataclass(frozen=True)
class Need:
    """``nbytes`` that ``key`` (a config key, or ``data.root`` for a size the data implies)
    set to ``value`` makes a run allocate at once, for ``what``; on the run's device (``device``)
    or in host memory."""

    key: str
    value: Any
    nbytes: int
    what: str
    device: bool = False
    fix: str = ""  # what to do instead (default: lower the key)
    # names (key, value) when the size has several possible sources; called only on refusal
    explain: Callable[[], tuple[str, Any]] | None = field(default=None, compare=False)


def human(n: float) -> str:
    """Bytes in words: ``512 B``, ``1.5 KiB``, ..., ``93.1 GiB``, ``2e+06 PiB``."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    n /= 1024
    return f"{n:.1f} PiB" if n < 1e4 else f"{n:.3g} PiB"


def _meminfo(name: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_left() -> int | None:
    """Bytes the process's cgroup (v2) may still take, when it has a limit."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        return max(0, int(limit) - used)
    except (OSError, ValueError):
        return None


def env_mib(name: str) -> int | None:
    """Bytes from the environment variable ``name`` in MiB (None when unset or empty); one
    line if it is not a number."""
    mb = os.environ.get(name)
    if not mb:
        return None
    try:
        return int(float(mb) * (1 << 20))
    except ValueError:
        raise ProtoflError(f"{name} = {mb!r} is not a number of MiB") from None


def host_available() -> int:
    """Bytes of host memory a run may take now (see the module docstring)."""
    given = env_mib(MEMORY_ENV)
    if given is not None:
        return given
    found = [v for v in (_meminfo("MemAvailable"), _cgroup_left()) if v is not None]
    if found:
        return min(found)
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 1 << 62  # unknown: refuse nothing


def available(device: torch.device | str | None = None) -> tuple[int, str]:
    """(bytes available, where in words) for allocations on ``device`` (None or a CPU/MPS
    device: host memory)."""
    info = devices.memory_info(device) if device is not None else None
    if info is None:
        return host_available(), "this machine"
    return info[0], str(device)


def check(needs: Iterable[Need], device: torch.device | str | None = None) -> None:
    """Refuse (one-line ProtoflError) when the needs of a pool exceed what it has available:
    the line names the largest need's key, value and bytes. Host needs are compared with host
    memory, device needs with the CUDA device's (on a CPU run both are host memory)."""
    needs = [n for n in needs if n.nbytes > 0]
    on_cuda = device is not None and devices.memory_info(device) is not None
    pools = {"host": [n for n in needs if not (on_cuda and n.device)],
             "device": [n for n in needs if on_cuda and n.device]}
    for pool, items in pools.items():
        if not items:
            continue
        total = sum(n.nbytes for n in items)
        free, where = available(device if pool == "device" else None)
        if total <= free:
            continue
        worst = max(items, key=lambda n: n.nbytes)
        if worst.explain is not None:
            key, value = worst.explain()
            worst = Need(key, value, worst.nbytes, worst.what, worst.device, worst.fix)
        rest = (f" ({human(total)} with the rest of the run)"
                if human(total) != human(worst.nbytes) else "")
        raise ProtoflError(
            f"config: {worst.key} = {worst.value}: {worst.what} would take "
            f"{human(worst.nbytes)} ({worst.nbytes} bytes){rest}, more than the {human(free)} "
            f"of memory {where} has available; {worst.fix or 'lower ' + worst.key}")


def check_labels(name: str, split: str, y: torch.Tensor | np.ndarray, num_classes: int,
                 void: int | None = None) -> None:
    """Every label of ``y`` lies in ``0 .. num_classes - 1`` (``void`` aside: a mask's
    ignored value): else one line naming the dataset, the split and the label, before any
    label indexes or sizes an array (``bincount``, a confusion matrix)."""
    a = y.numpy() if isinstance(y, torch.Tensor) else np.asarray(y)
    if a.size == 0:
        return
    if void is not None:
        a = a[a != void]
        if a.size == 0:
            return
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= num_classes:
        bad = hi if hi >= num_classes else lo
        raise ProtoflError(f"{name}: a {split} label of {bad} is outside the {num_classes} "
                           f"classes 0 .. {num_classes - 1} the data declares")


# ---- what a run needs ----

def tree_bytes(tree: Any) -> int:
    """Bytes of every tensor in a nested structure (meta tensors count their size)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tree_bytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(tree_bytes(v) for v in tree)
    return 0


def module_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of the parameters, bytes of the parameters and buffers) of a model."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params, params + sum(b.numel() * b.element_size() for b in model.buffers())


def numel(shape: Iterable[int]) -> int:
    return math.prod(int(s) for s in shape)


def optimizer_copies(clients) -> int:
    """Tensors the size of the weights that local training holds besides the weights: the
    gradients, and Adam's two moments or SGD's momentum buffer."""
    if clients.optimizer == "adam":
        return 3
    return 2 if clients.momentum else 1


CHECKPOINT_COPIES = 3  # a checkpoint's tensors are cloned, turned into bytes, then joined


def model_bytes(alg, spec, init_state: Callable[[Any], Any] | None = None,
                round_extra: int = 0, holds_clients: bool = True) -> int:
    """Bytes a (meta-built) algorithm holds at once, at least: its model(s); its server state
    (``init_state(alg)``, default ``alg.init_state(alg.model)``; a heterogeneous run's holds
    each group's initial weights: ``engine.hetero.init_state``);
    where there is no aggregate model (``global_weights`` is None: personalised methods) the
    own model of every client that trains, the smallest ones first; and the larger of a
    round's work (one client's training copy: weights, gradients, optimizer state; the
    round's uploads; ``round_extra``, e.g. a client's features for its prototypes) and a
    checkpoint's (``CHECKPOINT_COPIES`` copies of the state and the
    clients' models while they are encoded). ``holds_clients`` False (a Flower server or
    node, where each client's state stays on its node and a node writes no checkpoint):
    neither the clients' models nor the checkpoint's copies are counted."""
    groups = getattr(alg, "groups", None)
    models = groups.models if groups is not None else [alg.model]
    each = [module_bytes(m)[1] for m in models]
    held = sum(each)
    train = max(module_bytes(m)[0] for m in models) * (1 + optimizer_copies(spec.clients))
    try:  # the state's tables sized, not allocated; the caller's generator untouched
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            tree = init_state(alg) if init_state else alg.init_state(alg.model)
            state, own = tree_bytes(tree), alg.global_weights(tree) is None
    except Exception:  # noqa: BLE001 - an init_state that needs values: the weights, at least
        state, own = held, False
    clients = 0
    if own and holds_clients:
        trained = min(spec.data.num_clients, spec.rounds * spec.clients.per_round)
        per_client = (each[groups.of(k)] if groups is not None else each[0]
                      for k in range(spec.data.num_clients))
        clients = sum(sorted(per_client)[:trained])
    upload = sum(numel(e.shape) * FLOAT for e in alg.upload_spec().values())
    work = max(train + spec.clients.per_round * upload + round_extra,
               CHECKPOINT_COPIES * (state + clients) if holds_clients else 0)
    return held + state + clients + work


def schedule_bytes(rows: int, units: int, batch: int, by_steps: bool) -> int:
    """Bytes of one client's batch schedule (index tensors of every local batch, built before
    its first step): ``units`` epochs of ``rows`` indices, or ``units`` batches."""
    if rows <= 0:
        return 0
    per_batch = min(batch, rows)
    if by_steps:
        return units * (per_batch * 8 + TENSOR_BYTES)
    return units * (rows * 8 + -(-rows // per_batch) * TENSOR_BYTES)


def run_needs(spec, data, train_data, alg, explain: Callable[[], tuple[str, Any]] | None = None,
              init_state: Callable[[Any], Any] | None = None, holds_clients: bool = True
              ) -> list[Need]:
    """What a resolved run (``spec``) on ``data`` (clients train on ``train_data``) needs at
    once, with ``alg`` built on the meta device (``init_state``, ``holds_clients``: as
    ``model_bytes``).
    ``explain()`` names the key (and value) the model's size comes from; it is called only
    when that need is the one refused."""
    c, C = spec.clients, data.num_classes
    known = train_data.sizes_known and train_data.num_clients  # a site's: once nodes join
    rows = int(np.asarray(train_data.train_sizes).max()) if known else 0
    row = numel(data.input_shape)
    scores = C * (numel(data.input_shape[1:]) if data.task == "segmentation" else 1)
    units = c.local_steps or c.local_epochs or 1
    steps_key = "clients.local_steps" if c.local_steps else "clients.local_epochs"
    batch = min(c.batch_size, max(rows, 1))
    eval_rows = min(spec.metrics.eval_batch, max(len(data.y_test), len(data.y_local_test), 1))
    where = data.name if spec.data.root is None else spec.data.root
    present = int((np.asarray(data.class_counts).sum(0) > 0).sum()) if len(
        data.class_counts) else C
    protos = (any(e.kind == "prototypes" for e in alg.upload_spec().values())
              and spec.algo.get("proto_pass", "after") == "after" and data.task != "segmentation")
    groups = getattr(alg, "groups", None)
    width = max(getattr(m, "feature_dim", 0) or 0
                for m in (groups.models if groups is not None else [alg.model]))
    features = " (with a client's features over its rows, for its prototypes)" if protos else ""
    needs = [
        Need("model", "", model_bytes(alg, spec, init_state, rows * width * FLOAT * protos,
                                     holds_clients),
             f"the model, its server state, the clients' own models, and a round's training"
             f"{features} or a checkpoint's copies", device=True, explain=explain),
        Need(steps_key, units, schedule_bytes(rows, units, c.batch_size, c.local_steps
                                              is not None),
             f"a client's batch schedule ({rows} rows, batches of {batch})"),
        Need("clients.batch_size", c.batch_size, batch * (row + scores + width) * FLOAT,
             "a training batch (inputs, features and class scores)", device=True),
        Need("metrics.eval_batch", spec.metrics.eval_batch,
             eval_rows * (row + scores + width) * FLOAT,
             "an evaluation batch (inputs, features and class scores)", device=True),
    ]
    needs += [Need(k, v, n, what) for k, v, n, what in alg.server_bytes()]
    needs.append(Need("data.root" if spec.data.root else "data.name", where,
                      C * C * CONFUSION_ENTRY,
                      f"the confusion matrix of its {C} classes ({present} of them present "
                      "in the training labels)",
                      fix="number the classes 0, 1, 2, ... (the largest label sets the class "
                          "count)"))
    return needs
