"""Local training of a round's active clients together: one ``torch.func.vmap`` over stacked
per-client weights instead of a Python loop over clients.

It gives the result of ``train.SequentialTrainer`` (same batches, contexts, augmentation
generators, optimizer arithmetic): every client still goes through ``prepare_client`` and
``finish_client``; only the step loop differs. At step ``t`` the clients are sorted by their
number of steps (most first), so those that still have a step form a prefix ``[:n_t]`` of the
stack: the others (stragglers, small clients) are left out of the step, their weights and
optimizer state untouched. Where the cost model (``engine/costs.py``) says a vmap step of
``n_t`` clients costs more than ``n_t`` plain steps (the tail of a heavy-tailed round, where one
large client is left stepping), those clients take the plain step one by one: an ordinary
autograd pass on the client's own rows, the same optimizer arithmetic. Batches of unequal size
are padded by repeating a real row with weight ``w = 0`` (losses are weighted means, so padding
changes nothing). Per-batch statistics (``loss_and_stats``, ``has_aux`` under ``vmap``) are
summed per client over its last pass, as the sequential trainer sums them. Clients are trained
in chunks whose estimated memory fits a budget (on CUDA, a share of the device's free memory);
only active clients are ever stacked. The rows of a window of steps are gathered from the
stored rows (host memory) at once and converted there, then copied over (through pinned memory
on CUDA): a chunk's rows are never held twice.

How a step is taken is the chunk's ``Step`` (:class:`EagerStep` here; the compiled trainer,
``engine/compiled.py``, brings its own), so the loop is written once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.func import grad_and_value, vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from protofl import device as devices
from protofl.algorithms.base import Algorithm, Tensors
from protofl.engine import costs, optim
from protofl.engine.train import (
    ClientResult,
    ClientWork,
    LocalSetup,
    RoundContext,
    SequentialTrainer,
    finish_client,
    placed,
    prepare_client,
    transformed,
)
from protofl.models.nets import ProtoNet
from protofl.sizes import env_mib

log = logging.getLogger("protofl")

BUDGET_ENV = "PROTOFL_VECTORIZED_BUDGET_MB"
DEFAULT_BUDGET = 1 << 30  # bytes of stacked weights, optimizer state and activations per chunk
WINDOW_BYTES = 1 << 22  # rows of a window of steps gathered at once (about 4 MiB)
WINDOW_STEPS = 64
_logged: set[str] = set()


def vectorize_reason(model: ProtoNet) -> str | None:
    """None when ``model`` can be trained vectorized; else why not (one line)."""
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._NormBase):
            return (f"model has {type(m).__name__} ({name}), whose training-mode batch "
                    "statistics and running buffers cannot be vectorized over clients")
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            return (f"model has {type(m).__name__} ({name}), whose random masks would differ "
                    "from the sequential trainer's")
    return None


def precision_reason(precision: str) -> str | None:
    """None when ``precision`` trains vectorized; why not for fp16 (its loss scaler skips and
    rescales each client's steps on its own, which the sequential trainer does with
    ``torch.amp.GradScaler``)."""
    if precision == "fp16":
        return "fp16 training scales each client's loss with its own GradScaler"
    return None


def log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)


def memory_budget(device: torch.device | str = "cpu") -> int:
    """Bytes a chunk may use: ``$PROTOFL_VECTORIZED_BUDGET_MB``, else on CUDA a share of the
    device's free memory (``device.free_memory``), else 1 GiB."""
    given = env_mib(BUDGET_ENV)
    if given is not None:
        return given
    free = devices.free_memory(device)
    return DEFAULT_BUDGET if free is None else free


def activation_bytes(model: ProtoNet, params: Tensors, buffers: Tensors,
                     x: torch.Tensor) -> int:
    """Bytes of every module output for one sample (an estimate of what backward keeps)."""
    total = 0

    def hook(_m, _inp, out):
        nonlocal total
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        with torch.no_grad():
            torch.func.functional_call(model, {**params, **buffers}, (x[:1],), strict=False)
    finally:
        for h in handles:
            h.remove()
    return total


def batch_width(works: list[ClientWork]) -> int:
    """The widest batch of ``works`` (the width every batch of a stack is padded to)."""
    return max(b.shape[0] for w in works for b in w.batches)


def chunk_size(model: ProtoNet, start: Tensors, x: torch.Tensor, batch: int, budget: int) -> int:
    """How many clients fit ``budget``: per client, weights + gradients + optimizer state +
    temporaries (about 6 copies of the weights) and three times a batch's activations."""
    pbytes = sum(p.numel() * p.element_size() for p in start["params"].values())
    abytes = activation_bytes(model, start["params"], start["buffers"], x) * batch
    return max(1, budget // max(6 * pbytes + 3 * abytes, 1))


def trained_params(alg: Algorithm, work: ClientWork, start: Tensors) -> list[str]:
    """Names of the parameters the loss reaches (one autograd probe on the first batch). The
    others get no gradient, so torch.optim, and the vectorized trainer, leave them as they are
    (no weight decay, no optimizer state)."""
    params = {k: v.detach().clone().requires_grad_(True) for k, v in start["params"].items()}
    idx = work.batches[0]
    x, y = work.x[idx], work.y[idx]
    model = alg.model
    model.train()
    ones = torch.ones(len(y), dtype=x.dtype, device=x.device)
    loss = alg.loss(model, params, start["buffers"], x, y, ones, work.ctx)
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return [k for k, g in zip(params, grads) if g is not None]


def stack_tree(trees: list[Any], check_only: bool = False) -> tuple[Any, Any]:
    """Stack same-structured pytrees leaf by leaf; a leaf that is the very same object (or an
    equal non-tensor) in every tree is shared (``in_dims`` None) instead of copied.
    Returns ``(stacked tree, in_dims tree)`` (with ``check_only``, the first tree instead of
    the stack); raises ValueError if the trees disagree."""
    flats = [tree_flatten(t) for t in trees]
    spec = flats[0][1]
    if any(f[1] != spec for f in flats):
        raise ValueError("client contexts differ in structure")
    leaves, dims = [], []
    for i, first in enumerate(flats[0][0]):
        column = [f[0][i] for f in flats]
        if all(c is first for c in column) or not isinstance(first, torch.Tensor):
            if not all(c is first or c == first for c in column):
                raise ValueError("client contexts hold unequal non-tensor values")
            leaves.append(first)
            dims.append(None)
        else:
            if any(c.shape != first.shape for c in column):
                raise ValueError("client context tensors differ in shape")
            leaves.append(first if check_only else torch.stack(column))
            dims.append(0)
    return tree_unflatten(leaves, spec), tree_unflatten(dims, spec)


def part_tree(tree: Any, dims: Any, rows: slice | int) -> Any:
    """Clients ``rows`` of a stacked tree (a slice keeps the client dim, an int drops it;
    views; shared leaves unchanged)."""
    leaves, spec = tree_flatten(tree)
    dleaves = tree_flatten(dims)[0] if leaves else []
    return tree_unflatten([v[rows] if d == 0 else v for v, d in zip(leaves, dleaves)], spec)


@dataclass
class Stack:
    """A chunk's clients stacked (leading dim = client, most steps first): what a step
    updates."""

    alg: Algorithm
    setup: LocalSetup
    params: Tensors
    buffers: Any
    bdims: Any
    ctx: Any
    cdims: Any
    trained: list[str]
    opt: optim.SgdState | optim.AdamState

    @classmethod
    def of(cls, rc: RoundContext, works: list[ClientWork], starts: list[Tensors],
           trained: list[str]) -> Stack:
        params = {k: torch.stack([st["params"][k].detach() for st in starts])
                  for k in starts[0]["params"]}
        buffers, bdims = stack_tree([st["buffers"] for st in starts])
        ctx, cdims = stack_tree([w.ctx for w in works])
        opt = optim.init_state({k: params[k] for k in trained}, rc.setup)
        return cls(rc.alg, rc.setup, params, buffers, bdims, ctx, cdims, trained, opt)

    def size(self) -> int:
        return len(next(iter(self.params.values())))

    def in_dims(self) -> tuple:
        """vmap's ``in_dims`` of ``(params, buffers, x, y, w, ctx)``."""
        return ({k: 0 for k in self.params}, self.bdims, 0, 0, 0, self.cdims)


def client_loss(alg: Algorithm, setup: LocalSetup, p, b, x, y, w, c):
    """A client's loss and statistics (the forward under the run's precision)."""
    with devices.autocast(setup.device, setup.precision):
        return alg.loss_and_stats(alg.model, p, b, x, y, w, c)


def vmapped(alg: Algorithm, setup: LocalSetup, in_dims: tuple):
    """``(params, buffers, x, y, w, ctx) -> (grads, (losses, stats))`` over clients."""
    return vmap(grad_and_value(partial(client_loss, alg, setup), has_aux=True),
                in_dims=in_dims)


Step = Any  # (ns, x, y, w, sizes) -> (losses (k, n), statistics (k, n, ...)); see EagerStep


class EagerStep:
    """A step of the stack's first ``n`` clients: one vmap over them, or, where the cost model
    prefers it (``solo_max``), the plain step client by client."""

    steps = 1  # steps per call

    def __init__(self, stack: Stack, solo_max: int):
        self.stack, self.solo_max = stack, solo_max
        self.fn = vmapped(stack.alg, stack.setup, stack.in_dims())
        self.clients: dict[int, tuple] = {}  # client i's views of the stack, for plain steps

    def width(self, n: int) -> int:
        """How many clients' rows the step takes when ``n`` have its first step."""
        return n

    def __call__(self, ns: list[int], x: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
                 sizes: torch.Tensor) -> tuple[torch.Tensor, Tensors]:
        """One step of the first ``ns[0]`` clients (inputs ``(1, n, b, ...)``); the losses
        ``(1, n)`` and statistics ``(1, n, ...)``."""
        value, stats = self.one(ns[0], x[0], y[0], w[0], sizes[0])
        return value[None], tree_map(lambda v: v[None], stats)

    def one(self, n: int, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
            sizes: torch.Tensor) -> tuple[torch.Tensor, Tensors]:
        s = self.stack
        if n <= self.solo_max:
            out = [self.solo(i, x[i, :b], y[i, :b], w[i, :b])
                   for i, b in enumerate(sizes.tolist())]
            return (torch.stack([o[0] for o in out]),
                    tree_map(lambda *v: torch.stack(v), *(o[1] for o in out)))
        p = {k: v[:n] for k, v in s.params.items()}
        grads, (value, stats) = self.fn(p, part_tree(s.buffers, s.bdims, slice(n)), x, y, w,
                                        part_tree(s.ctx, s.cdims, slice(n)))
        optim.step_({k: p[k] for k in s.trained}, grads, s.opt.part(slice(n)), s.setup)
        return value.detach(), tree_map(torch.Tensor.detach, stats)

    def solo(self, i: int, x, y, w) -> tuple[torch.Tensor, Tensors]:
        """Client ``i``'s plain step: autograd on its own weights (views of the stack)."""
        s = self.stack
        if i not in self.clients:
            p = {k: v[i] for k, v in s.params.items()}
            leaves = [p[k].detach().requires_grad_(True) for k in s.trained]
            p.update(zip(s.trained, leaves))
            rows = slice(i, i + 1)
            self.clients[i] = (p, leaves, part_tree(s.buffers, s.bdims, i),
                               part_tree(s.ctx, s.cdims, i),
                               {k: s.params[k][rows] for k in s.trained}, s.opt.part(rows))
        p, leaves, buffers, ctx, own, opt = self.clients[i]
        loss, stats = client_loss(s.alg, s.setup, p, buffers, x, y, w, ctx)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        optim.step_(own, {k: (torch.zeros_like(v) if g is None else g).unsqueeze(0)
                          for k, v, g in zip(s.trained, leaves, grads)}, opt, s.setup)
        return loss.detach(), tree_map(torch.Tensor.detach, stats)


class Rows:
    """The chunk's batches: the global row of every (client, step, slot), each batch's true
    size, and the rows of a window of steps (a multiple of ``steps``) gathered (and
    converted) at once."""

    def __init__(self, rc: RoundContext, works: list[ClientWork], steps: int = 1):
        self.data, self.dev = rc.data, rc.setup.device
        offsets = [int(rc.data.train_offsets[w.job.client]) for w in works]
        total = -(-len(works[0].batches) // steps) * steps  # whole windows of ``steps``
        bmax = batch_width(works)
        rows = torch.empty(len(works), total, bmax, dtype=torch.long)
        sizes = torch.zeros(len(works), total, dtype=torch.long)
        for i, (w, off) in enumerate(zip(works, offsets)):
            rows[i] = off  # missing steps point at the client's first row (weight 0)
            if all(idx.shape[0] == bmax for idx in w.batches):  # the common case: full batches
                rows[i, :len(w.batches)] = torch.stack(w.batches) + off
                sizes[i, :len(w.batches)] = bmax
                continue
            for t, idx in enumerate(w.batches):
                rows[i, t, :len(idx)] = idx + off
                rows[i, t, len(idx):] = idx[0] + off  # padding repeats a real row
                sizes[i, t] = len(idx)
        self.rows, self.sizes, self.steps = rows, sizes, steps
        row_bytes = max(1, rc.data.x_train[:1].numel() * 4)
        fit = WINDOW_BYTES // (row_bytes * bmax * len(works))
        self.window = max(1, min(WINDOW_STEPS, fit) // steps) * steps
        self.start, self.x, self.y = 0, None, None
        # real rows weigh 1; (steps, clients, b), so a step's weights are contiguous (a
        # compiled step's graph is specialised to its inputs' strides)
        self.w = torch.empty(total, len(works), bmax, dtype=torch.bool)
        torch.lt(torch.arange(bmax), sizes.T[..., None], out=self.w)
        self.w = self.w.to(self.dev)

    def batch(self, t: int, k: int, m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Steps ``t .. t + k - 1``'s rows of the first ``m`` clients, ``(k, m, b, ...)``
        (gathered: new tensors, which the transforms may write into); ``k`` is padded to
        ``steps`` with steps that no client has."""
        k = self.steps if self.steps > 1 else k
        if self.x is None or not self.start <= t < self.start + self.window:
            r = self.rows[:m, t:t + self.window].transpose(0, 1)  # (window, m, b)
            self.x = self.data.inputs(devices.upload(self.data.x_train[r], self.dev))
            self.y = devices.upload(self.data.y_train[r], self.dev)
            self.start = t
        i = t - self.start
        x, y = self.x[i:i + k, :m], self.y[i:i + k, :m]
        return x, y, self.w[t:t + k, :m].to(x.dtype)


def add_stats(totals: list[torch.Tensor] | None, stats: list[torch.Tensor],
              count: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Add the statistics of a window of steps (leaves ``(steps, n, ...)``), each weighted by
    ``count`` ``(steps, n)`` (0 or 1: whether the client has the step and it is in its last
    pass), to per-client totals (``size`` clients; float64 where the device has it)."""
    if totals is None:
        totals = [torch.zeros(size, *v.shape[2:], dtype=devices.wide(v.device), device=v.device)
                  for v in stats]
    n = count.shape[1]
    for total, v in zip(totals, stats):
        c = count.reshape(*count.shape, *([1] * (v.dim() - 2)))
        total[:n] += (c * v.to(total.dtype)).sum(0)
    return totals


def train_chunk(rc: RoundContext, works: list[ClientWork], stack: Stack, step: Step
                ) -> tuple[list[Tensors], list[Tensors], list[float], list[Tensors | None]]:
    """Train the clients of ``works`` (sorted by steps, most first) together with ``step``,
    ``step.steps`` steps at a time. Returns weights, buffers, mean losses and last-pass
    statistics per client."""
    dev = rc.setup.device
    n_steps = [len(w.batches) for w in works]
    rows = Rows(rc, works, step.steps)
    losses = torch.zeros(len(works), dtype=devices.wide(dev), device=dev)
    stats_from = torch.tensor([w.stats_from for w in works], device=dev)
    totals, stats_spec = None, None
    rc.alg.model.train()
    for t in range(0, n_steps[0], step.steps):
        k = min(step.steps, n_steps[0] - t)
        ns = [sum(1 for m in n_steps if m > t + i) for i in range(k)]  # a prefix each
        x, y, w = rows.batch(t, k, step.width(ns[0]))
        sizes = rows.sizes[:ns[0], t:t + k].T
        if works[0].transform is not None:  # the same transforms for every client
            for i, n in enumerate(ns):
                for j, b in enumerate(sizes[i, :n].tolist()):
                    x[i, j, :b], y[i, j, :b] = transformed(rc.alg, works[j], x[i, j, :b],
                                                           y[i, j, :b])
        value, stats = step(ns, x, y, w, sizes)  # (k, ns[0]): the clients with a step t
        steps = torch.arange(t, t + k, device=dev)[:, None]
        act = (torch.arange(ns[0], device=dev) < torch.tensor(ns, device=dev)[:, None]
               ).to(losses.dtype)
        leaves, stats_spec = tree_flatten(stats)
        if leaves:
            totals = add_stats(totals, leaves, act * (stats_from[:ns[0]] <= steps), len(works))
        losses[:ns[0]] += (act * value).sum(0)
    per_client = losses.tolist()
    out_s = [None if totals is None else tree_unflatten([v[i] for v in totals], stats_spec)
             for i in range(len(works))]
    return (_unstack(stack.params, None, len(works)),
            _unstack(stack.buffers, stack.bdims, len(works)),
            [per_client[i] / max(n_steps[i], 1) for i in range(len(works))], out_s)


def _unstack(tree: Any, dims: Any, n: int) -> list[Any]:
    """Per-client copies of a stacked tree (shared leaves copied for each client)."""
    leaves, spec = tree_flatten(tree)
    dl = tree_flatten(dims)[0] if dims is not None and leaves else [0] * len(leaves)
    return [tree_unflatten([v[i].clone() if d == 0 else v.clone() for v, d in zip(leaves, dl)],
                           spec) for i in range(n)]


class VectorizedTrainer:
    """The round's jobs trained together (``vmap`` over clients), in chunks that fit a memory
    budget (bytes; default ``$PROTOFL_VECTORIZED_BUDGET_MB`` or 1 GiB). Gives the results of
    :class:`SequentialTrainer`, which it falls back to (logging why, once) when a round's
    client contexts cannot be stacked."""

    name = "vectorized"
    description = ("the round's clients stacked and trained together (torch.func.vmap), the "
                   "tail of a heavy-tailed round by the plain step")

    def __init__(self, budget: int | None = None, solo_max: int | None = None):
        self.budget = budget
        self.solo_max = solo_max  # clients that take plain steps (None: the cost model's)

    @staticmethod
    def unable(model: ProtoNet, precision: str, device: torch.device) -> str | None:
        return vectorize_reason(model) or precision_reason(precision)

    def estimate(self, work: costs.Work) -> float:
        return costs.vectorized_seconds(work)

    def make_step(self, rc: RoundContext, stack: Stack, works: list[ClientWork]) -> Step:
        if self.solo_max is not None:
            return EagerStep(stack, self.solo_max)
        work = costs.Work.of(rc.alg.model, works[0].x[:1], rc.setup.batch_size, rc.setup.device,
                             [len(w.batches) for w in works])
        return EagerStep(stack, costs.solo_max(work))

    def train(self, rc: RoundContext) -> list[ClientResult]:
        if not rc.jobs:
            return []
        reason = vectorize_reason(rc.alg.model) or precision_reason(rc.setup.precision)
        if reason is not None:
            log_once(f"training sequentially: {reason}")
            return SequentialTrainer().train(rc)
        rc = placed(rc)
        rc.alg.model.eval()
        works = [prepare_client(rc, j) for j in rc.jobs]
        starts = [rc.alg.local_start(rc.broadcast, rc.client_state(j.client)) for j in rc.jobs]
        try:
            stack_tree([w.ctx for w in works], check_only=True)
        except ValueError as e:
            log_once(f"training sequentially: {rc.alg.name}: {e}")
            return SequentialTrainer().train(rc)
        order = sorted(range(len(rc.jobs)), key=lambda i: -len(works[i].batches))
        bmax = batch_width(works)
        size = chunk_size(rc.alg.model, starts[0], works[0].x[:1], bmax,
                          memory_budget(rc.setup.device) if self.budget is None else self.budget)
        trained = trained_params(rc.alg, works[0], starts[0])
        results: list[ClientResult | None] = [None] * len(rc.jobs)
        for c in range(0, len(order), size):
            chunk = [works[i] for i in order[c:c + size]]
            stack = Stack.of(rc, chunk, [starts[i] for i in order[c:c + size]], trained)
            out_p, out_b, losses, stats = train_chunk(rc, chunk, stack,
                                                      self.make_step(rc, stack, chunk))
            for j, i in enumerate(order[c:c + size]):
                results[i] = finish_client(rc, works[i], out_p[j], out_b[j], losses[j],
                                           stats[j])
        return results  # type: ignore[return-value]
