"""Local training of a round's active clients together: one ``torch.func.vmap`` over stacked
per-client weights instead of a Python loop over clients.

It gives the result of ``train.SequentialTrainer`` (same batches, contexts, augmentation
generators, optimizer arithmetic): every client still goes through ``prepare_client`` and
``finish_client``; only the step loop differs. At step ``t`` the clients are sorted by their
number of steps (most first), so those that still have a step form a prefix ``[:n_t]`` of the
stack: the others (stragglers, small clients) are left out of the step, their weights and
optimizer state untouched. Batches of unequal size are padded by repeating a real row with
weight ``w = 0`` (losses are weighted means, so padding changes nothing). Per-batch statistics
(``loss_and_stats``, ``has_aux`` under ``vmap``) are summed per client over its last pass, as
the sequential trainer sums them. Clients are trained in chunks whose estimated memory fits a
budget (on CUDA, a share of the device's free memory); only active clients are ever stacked.
Each step's rows are gathered from the stored rows (host memory) and converted there, then
copied over (through pinned memory on CUDA): a chunk's rows are never held twice.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch.func import grad_and_value, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from protofl import device as devices
from protofl.algorithms.base import Algorithm, Tensors
from protofl.engine import optim
from protofl.engine.train import (
    ClientResult,
    ClientWork,
    RoundContext,
    SequentialTrainer,
    finish_client,
    placed,
    prepare_client,
    transformed,
)
from protofl.models.nets import ProtoNet

log = logging.getLogger("protofl")

BUDGET_ENV = "PROTOFL_VECTORIZED_BUDGET_MB"
DEFAULT_BUDGET = 1 << 30  # bytes of stacked weights, optimizer state and activations per chunk
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


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)


def memory_budget(device: torch.device | str = "cpu") -> int:
    """Bytes a chunk may use: ``$PROTOFL_VECTORIZED_BUDGET_MB``, else on CUDA a share of the
    device's free memory (``device.free_memory``), else 1 GiB."""
    mb = os.environ.get(BUDGET_ENV)
    if mb:
        return int(float(mb) * (1 << 20))
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


def _stack_tree(trees: list[Any], check_only: bool = False) -> tuple[Any, Any]:
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


def _slice_tree(tree: Any, dims: Any, n: int) -> Any:
    """The first ``n`` clients of a stacked tree (views; shared leaves unchanged)."""
    leaves, spec = tree_flatten(tree)
    dleaves = tree_flatten(dims)[0] if leaves else []
    return tree_unflatten([v[:n] if d == 0 else v for v, d in zip(leaves, dleaves)], spec)


def _row_index(works: list[ClientWork], offsets: list[int], steps: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Global row of every (client, step, slot) and each batch's true size; padding slots
    repeat the batch's first row (weight 0), missing steps point at the client's first row."""
    bmax = max(len(b) for w in works for b in w.batches)
    rows = torch.empty(len(works), steps, bmax, dtype=torch.long)
    sizes = torch.zeros(len(works), steps, dtype=torch.long)
    for i, (w, off) in enumerate(zip(works, offsets)):
        rows[i] = off
        if all(len(idx) == bmax for idx in w.batches):  # the common case: full batches
            rows[i, :len(w.batches)] = torch.stack(w.batches) + off
            sizes[i, :len(w.batches)] = bmax
            continue
        for t, idx in enumerate(w.batches):
            rows[i, t, :len(idx)] = idx + off
            rows[i, t, len(idx):] = idx[0] + off
            sizes[i, t] = len(idx)
    return rows, sizes


def _add_stats(totals: list[torch.Tensor] | None, stats: list[torch.Tensor], n: int,
               count: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Add the stacked statistics of the first ``n`` clients, each weighted 0 or 1
    (``count``: whether the step is in the client's last pass), to per-client totals
    (``size`` clients; float64 where the device has it)."""
    if totals is None:
        totals = [torch.zeros(size, *v.shape[1:], dtype=devices.wide(v.device), device=v.device)
                  for v in stats]
    for total, v in zip(totals, stats):
        c = count.reshape(-1, *([1] * (v.dim() - 1)))
        total[:n] += c * v.detach().to(total.dtype)
    return totals


def _train_chunk(rc: RoundContext, works: list[ClientWork], starts: list[Tensors],
                 trained: list[str]
                 ) -> tuple[list[Tensors], list[Tensors], list[float], list[Tensors | None]]:
    """Train the clients of ``works`` (sorted by steps, most first) together; only the
    parameters named in ``trained`` are updated. Returns weights, buffers, mean losses and
    last-pass statistics per client."""
    alg, model, data, setup = rc.alg, rc.alg.model, rc.data, rc.setup
    dev = setup.device
    n_steps = [len(w.batches) for w in works]
    steps = n_steps[0]
    params = {k: torch.stack([st["params"][k] for st in starts]).detach().clone()
              for k in starts[0]["params"]}
    buffers, bdims = _stack_tree([st["buffers"] for st in starts])
    ctx, cdims = _stack_tree([w.ctx for w in works])
    opt = optim.init_state({k: params[k] for k in trained}, setup)
    offsets = [int(data.train_offsets[w.job.client]) for w in works]
    rows, sizes = _row_index(works, offsets, steps)
    mask = (torch.arange(rows.shape[2]) < sizes[..., None]).to(dev)  # real rows (not padding)
    losses = torch.zeros(len(works), dtype=devices.wide(dev), device=dev)
    stats_from = torch.tensor([w.stats_from for w in works], device=dev)
    totals, stats_spec = None, None

    def client_loss(p, b, x, y, w, c):
        with devices.autocast(dev, setup.precision):  # the forward pass only, as sequentially
            return alg.loss_and_stats(model, p, b, x, y, w, c)

    # in_dims must mirror each argument's structure (vmap needs a prefix tree of the inputs).
    in_dims = ({k: 0 for k in params}, bdims, 0, 0, 0, cdims)
    step_fn = vmap(grad_and_value(client_loss, has_aux=True), in_dims=in_dims)
    model.train()
    for t in range(steps):
        n = sum(1 for m in n_steps if m > t)  # clients with a step t: a prefix
        b = int(sizes[:n, t].max())
        r = rows[:n, t, :b]  # gathered: new tensors, which the transforms may write into
        x = data.inputs(devices.upload(data.x_train[r], dev))
        y = devices.upload(data.y_train[r], dev)
        if works[0].transform is not None:  # the same transforms for every client
            for i in range(n):
                m = int(sizes[i, t])
                x[i, :m], y[i, :m] = transformed(alg, works[i], x[i, :m], y[i, :m])
        w = mask[:n, t, :b].to(x.dtype)
        p_n = {k: v[:n] for k, v in params.items()}
        grads, (value, stats) = step_fn(p_n, _slice_tree(buffers, bdims, n), x, y, w,
                                        _slice_tree(ctx, cdims, n))
        leaves, stats_spec = tree_flatten(stats)
        if leaves:
            totals = _add_stats(totals, leaves, n, (stats_from[:n] <= t).to(losses.dtype),
                                len(works))
        optim.step_({k: p_n[k] for k in trained}, grads, opt.head(n), setup)
        losses[:n] += value.detach().to(losses.dtype)
    out_p = [{k: v[i].clone() for k, v in params.items()} for i in range(len(works))]
    bl, bspec = tree_flatten(buffers)
    bd = tree_flatten(bdims)[0] if bl else []
    out_b = [tree_unflatten([v[i].clone() if d == 0 else v.clone() for v, d in zip(bl, bd)],
                            bspec) for i in range(len(works))]
    out_s = [None if totals is None else tree_unflatten([v[i] for v in totals], stats_spec)
             for i in range(len(works))]
    per_client = losses.tolist()
    return (out_p, out_b, [per_client[i] / max(n_steps[i], 1) for i in range(len(works))],
            out_s)


class VectorizedTrainer:
    """The round's jobs trained together (``vmap`` over clients), in chunks that fit a memory
    budget (bytes; default ``$PROTOFL_VECTORIZED_BUDGET_MB`` or 1 GiB). Gives the results of
    :class:`SequentialTrainer`, which it falls back to (logging why, once) when a round's
    client contexts cannot be stacked."""

    name = "vectorized"

    def __init__(self, budget: int | None = None):
        self.budget = budget

    def train(self, rc: RoundContext) -> list[ClientResult]:
        if not rc.jobs:
            return []
        reason = vectorize_reason(rc.alg.model) or precision_reason(rc.setup.precision)
        if reason is not None:
            _log_once(f"training sequentially: {reason}")
            return SequentialTrainer().train(rc)
        rc = placed(rc)
        rc.alg.model.eval()
        works = [prepare_client(rc, j) for j in rc.jobs]
        starts = [rc.alg.local_start(rc.broadcast, rc.client_state(j.client)) for j in rc.jobs]
        try:
            _stack_tree([w.ctx for w in works], check_only=True)
        except ValueError as e:
            _log_once(f"training sequentially: {rc.alg.name}: {e}")
            return SequentialTrainer().train(rc)
        order = sorted(range(len(rc.jobs)), key=lambda i: -len(works[i].batches))
        bmax = max(len(b) for w in works for b in w.batches)
        dev = rc.setup.device
        size = chunk_size(rc.alg.model, starts[0], works[0].x[:1],
                          bmax, memory_budget(dev) if self.budget is None else self.budget)
        trained = trained_params(rc.alg, works[0], starts[0])
        results: list[ClientResult | None] = [None] * len(rc.jobs)
        for c in range(0, len(order), size):
            chunk = order[c:c + size]
            out_p, out_b, losses, stats = _train_chunk(rc, [works[i] for i in chunk],
                                                       [starts[i] for i in chunk], trained)
            for j, i in enumerate(chunk):
                results[i] = finish_client(rc, works[i], out_p[j], out_b[j], losses[j],
                                           stats[j])
        return results  # type: ignore[return-value]
