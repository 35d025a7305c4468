"""The compiled trainer: the vectorized trainer's loop with every window of steps (at each,
the clients' forward and backward under ``vmap`` and the optimizer update) compiled into one
graph by ``torch.compile``. On a CPU a window is a loop in the graph (torch's ``scan``:
traced and compiled once, whatever its length) of at most ``costs.LOOPED_STEPS`` steps; on
CUDA its steps are unrolled (at most ``costs.COMPILED_STEPS``), so that the window replays as
one CUDA graph. The window is fixed by the trainer's first round (``costs.window``: 20 local
steps run as one window of 20 on a CPU, three of 7 unrolled).

A step of small models is mostly overhead (Python, dispatch, autograd bookkeeping): compiled,
and its call shared by the window's steps, the Synthetic MLP's step costs about a fifth of the
eager one (240 against 1,174 us a step, measured with benchmarks/trainer_costs.py). A graph has
a fixed shape, so steps of ``n`` clients run at the stack size ``bucket(n)`` (the next power of
two), the clients past their last step marked inactive and left exactly as they were
(``optim.step_``'s ``active``), and a window past a client's last step padded with steps no
client has; a run compiles at most ``log2(K') + 1`` sizes, each once (seconds each on a CPU;
torch's compile caches, kept in protofl's cache folder (``engine/cache.py``), serve later
runs).
Batches keep their padded width (weight-0 rows).
On a CPU the graph is C++ (``cpp_wrapper``); on CUDA it is replayed as a CUDA graph.

Results match the sequential trainer's within the equivalence tests' tolerance (the compiled
arithmetic fuses and orders operations its own way); the looped and unrolled windows give the
same numbers. Where ``torch.compile`` cannot compile the step (no C++ compiler, an operation it
cannot trace), the trainer says why once and takes the eager steps of the vectorized trainer.
"""

from __future__ import annotations

import shutil
import types
from typing import NamedTuple

import torch
from torch.utils._pytree import tree_map

from protofl.algorithms.base import Algorithm, Tensors
from protofl.engine import cache, costs, optim
from protofl.engine.train import ClientWork, LocalSetup, RoundContext
from protofl.engine.vectorized import (
    Stack,
    Step,
    VectorizedTrainer,
    log_once,
    part_tree,
    vmapped,
)
from protofl.models.nets import ProtoNet

try:  # torch's loop in a graph (a higher-order op; newer torch only)
    from torch._higher_order_ops.scan import scan as _scan
except ImportError:  # pragma: no cover - older torch: windows unrolled
    _scan = None


def _scan_cached() -> dict:
    """torch.compile options that let torch's compile caches keep graphs holding a scan,
    which they skip unless told otherwise: its body is a subgraph that their keys hash in
    full (as they do invoke_subgraph's, which torch caches), and the key names torch's
    version, which fixes scan's own code."""
    import torch._inductor.config as inductor

    if _scan is None or not hasattr(inductor, "unsafe_marked_cacheable_functions"):
        return {}
    return {"unsafe_marked_cacheable_functions":
            {"torch.ops.higher_order.scan": torch.__version__}}


def compile_reason(device: torch.device) -> str | None:
    """None when ``torch.compile`` can compile a step for ``device``; else why not."""
    if device.type not in ("cpu", "cuda"):
        return f"torch.compile trains on the CPU or CUDA here, not {device.type}"
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python"
    if device.type == "cpu" and not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        return "torch.compile needs a C++ compiler for CPU code (none on the PATH)"
    return None


def _steps(alg: Algorithm, setup: LocalSetup, in_dims: tuple, trained: tuple[str, ...],
           kind: type, looped: bool, params: Tensors, buffers, x, y, w, ctx, opt: Tensors,
           active: torch.Tensor):
    """Steps of a stack of clients, as one graph: at each, the gradients, then the update of
    that step's ``active`` clients' trained weights and optimizer state (written back in
    place at the end). ``looped``: the steps as a loop in the graph (torch's ``scan``: traced
    and compiled once), else one after another (each traced and compiled).
    Inputs ``(steps, m, b, ...)``, ``active`` ``(steps, m)``."""
    step = vmapped(alg, setup, in_dims)
    frozen = {k: v for k, v in params.items() if k not in trained}

    def one(carry, xs):
        p, o = carry
        grads, out = step({**frozen, **p}, buffers, *xs[:3], ctx)
        p, o = {k: v.clone() for k, v in p.items()}, tree_map(torch.clone, o)
        optim.step_(p, grads, kind(**o), setup, xs[3])
        return (p, o), out

    start = carry = ({k: params[k] for k in trained}, opt)
    if looped:
        carry, (values, stats) = _scan(one, carry, (x, y, w, active))
    else:
        outs = []
        for i in range(x.shape[0]):
            carry, out = one(carry, (x[i], y[i], w[i], active[i]))
            outs.append(out)
        values, stats = tree_map(lambda *v: torch.stack(v), *outs)
    tree_map(lambda dst, new: dst.copy_(new), start, carry)
    return values, stats


def window_limit(device: torch.device | str) -> int:
    """The most steps in one graph on ``device``: ``costs.LOOPED_STEPS`` where the window is a
    loop in the graph (a CPU, with torch's ``scan``), else ``costs.COMPILED_STEPS``."""
    return costs.LOOPED_STEPS if _looped(torch.device(device)) else costs.COMPILED_STEPS


def _looped(device: torch.device) -> bool:
    # on CUDA the unrolled window replays as one CUDA graph, which a loop would break
    return device.type == "cpu" and _scan is not None


class GraphKey(NamedTuple):
    """A compiled graph's key: one per algorithm, stack size and learning rate (a decayed
    learning rate is a new graph)."""

    alg: int  # id() of the algorithm
    size: int  # the stack size
    lr: float


def _fresh(m: int):
    """``_steps`` as a function of its own code object: each stack size keeps its own cache
    of compiled graphs (torch.compile limits the graphs cached per code object)."""
    code = _steps.__code__.replace(co_name=f"protofl_steps_{m}")
    return types.FunctionType(code, _steps.__globals__, code.co_name)


class CompiledStep:
    """``steps`` steps (a window) of the stack's first clients at the compiled stack size
    ``bucket(n)``, ``n`` the clients with the first of them; the vectorized trainer's eager
    step (``fallback``) where compiling fails."""

    def __init__(self, stack: Stack, graphs: dict, fallback: Step, steps: int):
        self.steps = steps
        self.stack, self.graphs, self.fallback = stack, graphs, fallback
        self.most = stack.size()
        self.failed = False
        self.dev = next(iter(stack.params.values())).device
        self.args: dict[int, tuple] = {}  # the stack's views at each size (they stay valid)

    def width(self, n: int) -> int:
        return n if self.failed else costs.bucket(n, self.most)

    def _prepared(self, m: int) -> tuple:
        """The graph of stack size ``m`` and its arguments but the batch and the mask."""
        if m not in self.args:
            s, rows = self.stack, slice(m)
            key = GraphKey(id(s.alg), m, s.setup.lr)
            if key not in self.graphs:
                for old in [k for k in self.graphs if k[:2] == key[:2]]:
                    del self.graphs[old]  # an earlier round's learning rate
                cache.use_torch_cache()
                options = ({"triton.cudagraphs": True} if self.dev.type == "cuda"
                           else {"cpp_wrapper": True, **_scan_cached()})
                self.graphs[key] = torch.compile(_fresh(m), fullgraph=True, dynamic=False,
                                                 options=options)
            self.args[m] = (self.graphs[key], (
                s.alg, s.setup, s.in_dims(), tuple(s.trained), type(s.opt),
                _looped(self.dev),
                {k: v[rows] for k, v in s.params.items()}, part_tree(s.buffers, s.bdims, rows)),
                part_tree(s.ctx, s.cdims, rows), vars(s.opt.part(rows)))
        return self.args[m]

    def __call__(self, ns: list[int], x: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
                 sizes: torch.Tensor) -> tuple[torch.Tensor, Tensors]:
        """Steps of the first ``ns[i]`` clients each (inputs ``(steps, m, b, ...)``, the
        steps past ``len(ns)`` no client's); losses ``(len(ns), ns[0])`` and statistics."""
        if not self.failed:
            m = x.shape[1]
            counts = torch.tensor(ns + [0] * (len(x) - len(ns)), device=self.dev)
            active = torch.arange(m, device=self.dev) < counts[:, None]
            try:
                fn, head, ctx, opt = self._prepared(m)
                value, stats = fn(*head, x, y, w, ctx, opt, active)
                k, n = len(ns), ns[0]
                return value[:k, :n].detach(), tree_map(lambda v: v[:k, :n].detach(), stats)
            except Exception as e:  # noqa: BLE001 - compiling failed: say why, go on eagerly
                first = str(e).splitlines()[0] if str(e) else ""
                log_once(f"compiled trainer: torch.compile failed ({type(e).__name__}: "
                         f"{first}); training with eager steps")
                self.failed = True
        out = [self.fallback.one(n, x[i, :n], y[i, :n], w[i, :n], sizes[i, :n])
               for i, n in enumerate(ns)]
        pad = lambda v: torch.nn.functional.pad(  # noqa: E731 - to the first step's clients
            v, (0, 0) * (v.dim() - 1) + (0, ns[0] - len(v)))
        return (torch.stack([pad(o[0]) for o in out]),
                tree_map(lambda *v: torch.stack([pad(t) for t in v]), *(o[1] for o in out)))


class CompiledTrainer(VectorizedTrainer):
    """The vectorized trainer with each step compiled (``torch.compile``); pays a one-off
    compile of a few seconds per stack size, then the least per step."""

    name = "compiled"
    description = ("the vectorized trainer with every step compiled by torch.compile (a "
                   "compile of seconds per stack size, then the cheapest step)")

    def __init__(self, budget: int | None = None):
        super().__init__(budget)
        self.graphs: dict = {}  # compiled steps by stack size, kept for the run
        self.window: int | None = None  # steps per graph: set by the first round

    @staticmethod
    def unable(model: ProtoNet, precision: str, device: torch.device) -> str | None:
        return (VectorizedTrainer.unable(model, precision, device)
                or compile_reason(torch.device(device)))

    def estimate(self, work: costs.Work) -> float:
        steps = self.window or costs.window(max(work.steps, default=0),
                                            window_limit(work.device))
        return costs.compiled_seconds(work, frozenset(k.size for k in self.graphs), steps)

    def make_step(self, rc: RoundContext, stack: Stack, works: list[ClientWork]) -> Step:
        if self.window is None:
            self.window = costs.window(max(len(w.batches) for w in works),
                                       window_limit(rc.setup.device))
        return CompiledStep(stack, self.graphs, super().make_step(rc, stack, works),
                            self.window)
