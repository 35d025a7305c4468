"""Client-level differential privacy and secure sums as a chain of pure layers
(docs/privacy.md).

A privacy layer is a pair ``init() -> state`` and ``update(state, step) -> (state, step)``
over explicit state (Optax's transformations, TensorFlow Federated's aggregation factories):
a round's :class:`Step` (the replies, the broadcast, the server state, the round's
:class:`~protofl.privacy.contrib.SumForm`, the sum, the noise multipliers released so far,
the metrics line's figures, the next state) passes through the layers in order, each
returning the step it made and its own next state. :func:`chain` composes layers into the
one :class:`Chain` the round loop talks to (an ``Aggregation``); :func:`layers` builds the
chain a run's ``privacy`` section asks for:

- :class:`AdaptiveClip` (``privacy.adaptive_clip``): the clip norm follows a target quantile
  of the clients' update norms, estimated privately (Andrew et al., NeurIPS 2021);
- :class:`ServerClip` (server-side noise: the clients send raw uploads and the server makes
  each its clipped contribution) or :class:`ClientClip` (client-side noise, secure sums: each
  client computes its contribution, with its noise share, before it leaves);
- :class:`Sum`: the contributions' sum;
- :class:`GaussianNoise` (DP): the server's noise on the sum (from the OS's CSPRNG; with
  ``privacy.reproducible_noise``, tests only, from (seed, NOISE, round)), or none when the
  clients added it; either way it reports the noise multipliers the sum carries;
- :class:`Estimate`: the algorithm's ``aggregate_private`` makes the next state from the
  sum's estimate;
- :class:`Accounting` (DP): epsilon after every round from the multipliers the noise layers
  reported (never from the core), and the budget asked before the next.

Nothing here names an algorithm's upload key: ``UploadEntry.kind`` says what each entry is.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from protofl.algorithms.base import Algorithm, Tensors, UploadEntry
from protofl.algorithms.capabilities import sums, sums_reason
from protofl.config import Config
from protofl.engine.aggregation import Aggregation
from protofl.errors import ProtoflError
from protofl.nested import flatten
from protofl.privacy.accountant import Accountant, Budget
from protofl.privacy.contrib import SumForm, SumSettings, check_secure_range
from protofl.privacy.noise import effective_multiplier, gaussian, noise_source
from protofl.seeding import CLIENT_NOISE, CLIP_NOISE, NOISE

if TYPE_CHECKING:
    from protofl.engine.train import RoundContext

log = logging.getLogger("protofl")

MIN_MULTIPLIER = 0.1  # a round's combined noise multiplier below this: refused


def dp_on(cfg: Config) -> bool:
    return cfg.privacy.noise_multiplier > 0


def check(cfg: Config, alg: Algorithm) -> None:
    """One ProtoflError line for a ``privacy`` section the algorithm or the run cannot meet."""
    p, dp = cfg.privacy, dp_on(cfg)
    if not dp and p.budget is not None:
        raise ProtoflError("config: privacy.budget needs privacy.noise_multiplier > 0")
    if p.adaptive_clip and (not dp or p.noise == "client" or p.secagg):
        raise ProtoflError("config: privacy.adaptive_clip needs privacy.noise_multiplier > 0 "
                           "with noise: server and no secagg (the server, which clips, "
                           "keeps the clip norm)")
    if not dp and not p.secagg:
        return
    if cfg.data.pooled:
        raise ProtoflError(f"privacy: {alg.name} trains on the pooled data of every client; "
                           "client-level DP and secure aggregation do not apply to it")
    if cfg.metrics.ffd_reference and (p.secagg or p.noise == "client"):
        raise ProtoflError("metrics.ffd_reference compares each client's model with the "
                           "reference, but under privacy.secagg or privacy.noise: client the "
                           "server holds only sums; leave one of them out")
    reason = sums_reason(alg)
    if p.secagg and reason:
        raise ProtoflError(f"privacy.secagg: {alg.name} cannot run under secure aggregation: "
                           f"{reason}")
    if p.secagg and cfg.clients.per_round < 2:
        raise ProtoflError("privacy.secagg needs clients.per_round >= 2 (a sum of one upload "
                           "is that upload)")
    if not dp:
        return
    if p.noise == "client" and reason:
        raise ProtoflError(f"privacy.noise = client: {alg.name}'s server cannot work from "
                           f"noised sums: {reason}; use privacy.noise: server")
    why = dp_refusal(alg)
    if why:
        raise ProtoflError(f"privacy: {alg.name} cannot be trained with client-level DP: {why}")
    if cfg.clients.sampling == "weighted":
        raise ProtoflError("privacy: clients.sampling = weighted picks clients by their data "
                           "size, which no DP accountant covers; set clients.sampling: uniform")


def dp_refusal(alg: Algorithm) -> str:
    """Why ``alg`` cannot be trained with client-level DP even under server-side noise ("" when
    it can): the server may score raw uploads (bounded client weights), but a rule that is no
    ratio of sums, or reads an upload for more than a weight, is refused."""
    if not sums(alg):
        return sums_reason(alg)
    others = [k for k, e in alg.upload_spec().items() if e.kind == "other"]
    return f"its server reads {others[0]!r} of each client" if others else ""


# ---- the chain ----

@dataclass(frozen=True)
class Step:
    """One round's message through the chain: each layer returns a new one
    (``replace``), never changes the one it was given."""

    round: int
    broadcast: Tensors
    server: Tensors  # the server state the round started from
    replies: Sequence[Tensors]  # the clients' replies, then their contributions
    form: SumForm  # how contributions are made and noised this round
    total: Tensors | None = None  # the contributions' sum (then noised)
    received: float = 0.0  # contributions in the sum
    releases: tuple[float, ...] = ()  # noise multipliers of the parts released this round
    diag: dict[str, Any] = field(default_factory=dict)  # the metrics line's figures
    state: Tensors | None = None  # the next server state


class PrivacyLayer:
    """One layer of a :class:`Chain`: ``update`` maps (its state, a step) to (its next state,
    the next step); nothing else of it changes during a run. Its state is a dict of plain
    values (checkpointed under the run's ``privacy`` entry, merged with the other layers':
    keys must differ).

    A layer also declares, once: ``replies`` ("uploads" or "contributions": what the clients
    send, said by the layer that takes them), ``noised`` and ``client_noise``, its client
    part (``client_hook``), the multipliers one full round releases (``plan``), the figures
    it adds after a round (``report``) and why a round may not run (``stop_reason``).
    """

    replies: str | None = None
    noised = False
    client_noise = False

    def init(self) -> dict[str, Any]:
        return {}

    def update(self, state: dict[str, Any], step: Step) -> tuple[dict[str, Any], Step]:
        return state, step

    def client_hook(self, form: SumForm, noise_seed: int | None = None):
        return None

    def plan(self, form: SumForm) -> tuple[float, ...]:
        return ()

    def report(self, state: dict[str, Any], record: dict, round: int) -> None:
        pass

    def stop_reason(self, state: dict[str, Any], round: int, plan: tuple[float, ...]) -> str:
        return ""


class Chain(Aggregation):
    """Layers composed in order into the one aggregation the round loop talks to; it holds
    the layers' states (its only mutable part) and threads them through ``update``."""

    private = True

    def __init__(self, alg: Algorithm, form: SumForm, layers: Sequence[PrivacyLayer]):
        super().__init__(alg)
        self.form, self.layers = form, tuple(layers)
        keys = [k for layer in self.layers for k in layer.init()]
        if len(keys) != len(set(keys)):
            raise ValueError(f"privacy chain: two layers keep the same state entry ({keys})")
        self.states = [layer.init() for layer in self.layers]

    def __repr__(self) -> str:
        return f"chain({', '.join(type(layer).__name__ for layer in self.layers)})"

    @property
    def individual(self) -> bool:
        said = [layer.replies for layer in self.layers if layer.replies]
        return not said or said[0] == "uploads"

    @property
    def noised(self) -> bool:
        return any(layer.noised for layer in self.layers)

    @property
    def client_noise(self) -> bool:
        return any(layer.client_noise for layer in self.layers)

    def client_hook(self, noise_seed: int | None = None):
        hooks = [layer.client_hook(self.form, noise_seed) for layer in self.layers]
        return next((h for h in hooks if h is not None), None)

    def reply_spec(self) -> dict[str, UploadEntry]:
        return self.alg.upload_spec() if self.individual else self.form.spec()

    def aggregate(self, state, broadcast, replies, round):
        step = Step(round, broadcast, state, list(replies), self.form)
        states = []
        for layer, own in zip(self.layers, self.states):
            own, step = layer.update(own, step)
            states.append(own)
        self.states = states
        return (state if step.state is None else step.state), dict(step.diag)

    def plan(self) -> tuple[float, ...]:
        """The noise multipliers one round at full participation releases."""
        return tuple(m for layer in self.layers for m in layer.plan(self.form))

    def after_round(self, record, round):
        for layer, own in zip(self.layers, self.states):
            layer.report(own, record, round)

    def stop_reason(self, round):
        plan = self.plan()
        for layer, own in zip(self.layers, self.states):
            why = layer.stop_reason(own, round, plan)
            if why:
                return why
        return ""

    def epsilon(self) -> float:
        """Epsilon at ``delta`` after the rounds so far (the accounting layer's)."""
        for layer, own in zip(self.layers, self.states):
            if isinstance(layer, Accounting):
                return layer.epsilon(own)
        return 0.0

    def state_dict(self):
        return {k: v for own in self.states for k, v in own.items()}

    def load_state_dict(self, state):
        self.states = [layer.load(state) if hasattr(layer, "load") else
                       {k: state.get(k, v) for k, v in layer.init().items()}
                       for layer in self.layers]


def chain(*layers: PrivacyLayer, alg: Algorithm, form: SumForm) -> Chain:
    """Compose ``layers`` (in the order a round passes them) into one aggregation of
    ``alg``'s uploads made into contributions by ``form``. :func:`layers` builds the chain a
    config asks for; a user composes their own the same way and passes it as
    ``Experiment(cfg, aggregation=...)``."""
    return Chain(alg, form, layers)


# ---- the layers ----

class ServerClip(PrivacyLayer):
    """Clients send their raw uploads; the server makes each its (clipped) contribution and
    logs the client weights (and, under DP, how many updates were clipped)."""

    replies = "uploads"

    def update(self, state, step):
        form = step.form
        pairs = [form.contribution(u, step.broadcast, step.server) for u in step.replies]
        diag: dict[str, Any] = {}
        if form.weights:
            w = np.array([float(c["weight"]) for c, _ in pairs])
            diag["weights"] = (w / w.sum() if w.sum() > 0 else w).tolist()
            if form.settings.private:
                norms = [n for _, n in pairs]
                diag["clipped"] = int(sum(n > form.settings.clip for n in norms))
                diag["update_norm"] = float(np.median(norms))
        return state, replace(step, replies=[c for c, _ in pairs],
                                          diag={**step.diag, **diag})


class ClientClip(PrivacyLayer):
    """Each client computes its contribution (with its share of the noise under client-side
    DP) before the upload leaves it; the replies are contributions."""

    replies = "contributions"

    def __init__(self, seed: int, secure_range: float | None, reproducible: bool,
                 client_noise: bool):
        self.seed, self.reproducible = seed, reproducible
        self.secure_range = secure_range  # secure sums: what SecAgg+ can carry
        self.client_noise = client_noise

    def client_hook(self, form: SumForm, noise_seed: int | None = None
                    ) -> Callable[[RoundContext, int, Tensors], Tensors]:
        """The hook making an upload a contribution; client-side noise is drawn from the
        OS's CSPRNG, or with ``privacy.reproducible_noise`` (tests only) from ``noise_seed``
        (a node's own), else the run seed."""
        seed = self.seed if noise_seed is None else noise_seed
        noisy, reach, reproducible = self.client_noise, self.secure_range, self.reproducible

        def contribute(rc: RoundContext, client: int, upload: Tensors) -> Tensors:
            gen = noise_source(reproducible, seed, CLIENT_NOISE, rc.round,
                               client) if noisy else None
            out = form.contribution(upload, rc.broadcast, None, gen)[0]
            if reach is not None:
                check_secure_range(out, form.spec(), reach, client)
            return out
        return contribute


class Sum(PrivacyLayer):
    """The entrywise sum of the round's contributions, and how many it holds."""

    def update(self, state, step):
        total = SumForm.total(step.replies)
        return state, replace(step, total=total, received=float(total["members"]))


class GaussianNoise(PrivacyLayer):
    """DP noise on the sum: the server draws it (``by`` "server": from the OS's CSPRNG, or
    with ``reproducible``, tests only, from the run seed), or the clients have added their
    shares (``by`` "client"). Either way it reports the noise multiplier of each part the sum
    carries (fewer clients: less of the clients' noise) for the accounting."""

    noised = True

    def __init__(self, by: str, seed: int, reproducible: bool):
        self.by, self.seed, self.reproducible = by, seed, reproducible
        self.client_noise = by == "client"

    def update(self, state, step):
        total, form = step.total, step.form
        if self.by == "server":
            total = form.noised(total, noise_source(self.reproducible, self.seed, NOISE,
                                                    step.round))
        released = form.part_multipliers(step.received if self.client_noise else None)
        return state, replace(step, total=total,
                                          releases=step.releases + tuple(released))

    def plan(self, form):
        return tuple(form.part_multipliers())


class Estimate(PrivacyLayer):
    """The core: the algorithm's ``aggregate_private`` makes the next state from the
    estimate of the (noised) sum."""

    def update(self, state, step):
        nxt, diag = step.form.alg.aggregate_private(
            step.server, step.form.estimate(step.total, step.broadcast), step.round)
        diag.pop("weights", None)  # the estimate's one weight says nothing
        return state, replace(step, state=nxt, diag={**diag, **step.diag})


class Accounting(PrivacyLayer):
    """Client-level DP's accountant: each round's noise multiplier is what the noise layers
    reported for it (the parts combined, ``effective_multiplier``); ``epsilon`` after every
    round, and the budget asked before the next (at the planned, full noise)."""

    def __init__(self, accountant: Accountant, budget: Budget | None, reproducible: bool):
        self.accountant, self.budget, self.reproducible = accountant, budget, reproducible

    def init(self):
        return {"multipliers": []}

    def load(self, state):
        return {"multipliers": [float(m) for m in state.get("multipliers", [])]}

    def update(self, state, step):
        return {"multipliers": [*state["multipliers"], effective_multiplier(step.releases)]}, step

    def epsilon(self, state) -> float:
        """Epsilon at ``delta`` after the rounds so far."""
        return self.accountant.epsilon_of(state["multipliers"])

    def report(self, state, record, round):
        record["epsilon"] = self.epsilon(state)
        if self.reproducible:  # its noise can be regenerated from the seed
            record["private"] = False

    def stop_reason(self, state, round, plan):
        """"privacy budget" when round ``round`` would exceed it (at full noise)."""
        if self.budget is None:
            return ""
        eps = self.accountant.epsilon_of([*state["multipliers"], effective_multiplier(plan)])
        return "" if self.budget.allows(round, eps) else "privacy budget"


class AdaptiveClip(PrivacyLayer):
    """Adaptive clipping (Andrew, Thakkar, McMahan and Ramaswamy, NeurIPS 2021): the clip norm
    C of the weights update follows the ``quantile`` gamma of the clients' update norms.

    In round t each client's bit is b_k = 1[||Delta_k|| <= C_t]; the server releases the
    centred count S = sum_k (b_k - 1/2) + N(0, sigma_b^2) (one client moves it by at most
    1/2, so its noise multiplier is 2 sigma_b), estimates the unclipped fraction
    b = S / K' + 1/2 and sets C_{t+1} = C_t exp(-eta (b - gamma)). The round's updates are
    clipped at C_t and noised with sigma_Delta = (sigma^-2 - (2 sigma_b)^-2)^(-1/2), so that
    the two releases together are one Gaussian mechanism of multiplier sigma (Renyi DP of
    Gaussians adds up: sigma_Delta^-2 + (2 sigma_b)^-2 = sigma^-2); the accounting composes
    what each reports. It comes first in the chain (it reads the raw uploads: the server
    clips, ``noise: server``). State: ``{"clip": C}``.
    """

    def __init__(self, initial: float, quantile: float, lr: float, count_std: float,
                 multiplier: float, clients: int, seed: int, reproducible: bool):
        if not 2 * count_std > multiplier:
            raise ProtoflError(
                f"privacy.clip_count_std = {count_std:g}: adaptive clipping needs 2 x it above "
                f"privacy.noise_multiplier = {multiplier:g} (the count's noise takes part of "
                f"the privacy of every round); raise it above {multiplier / 2:g}")
        self.initial, self.quantile, self.lr = initial, quantile, lr
        self.count_std, self.clients = count_std, clients
        self.seed, self.reproducible = seed, reproducible
        self.delta_multiplier = update_multiplier(multiplier, count_std)

    def init(self):
        return {"clip": float(self.initial)}

    def update(self, state, step):
        clip = state["clip"]
        norms = [step.form.update_norm(u, step.broadcast) for u in step.replies]
        centred = sum((1.0 if n <= clip else 0.0) - 0.5 for n in norms)
        gen = noise_source(self.reproducible, self.seed, CLIP_NOISE, step.round)
        noisy = centred + self.count_std * float(gaussian((1,), torch.float64, gen)[0])
        fraction = noisy / self.clients + 0.5
        nxt = clip * math.exp(-self.lr * (fraction - self.quantile))
        form = step.form.adjusted(clip=clip, delta_multiplier=self.delta_multiplier)
        diag = {**step.diag, "clip_norm": clip, "unclipped_fraction": fraction}
        return {"clip": nxt}, replace(
            step, form=form, diag=diag, releases=step.releases + (2 * self.count_std,))

    def plan(self, form):
        return (2 * self.count_std,)

    def plan_form(self, form: SumForm) -> SumForm:
        return form.adjusted(delta_multiplier=self.delta_multiplier)


def update_multiplier(multiplier: float, count_std: float) -> float:
    """sigma_Delta = (sigma^-2 - (2 sigma_b)^-2)^(-1/2): the updates' noise multiplier that
    leaves a round of adaptive clipping (updates and the noised count together) at
    ``multiplier``."""
    return (multiplier ** -2 - (2 * count_std) ** -2) ** -0.5


def layers(cfg: Config, alg: Algorithm, num_clients: int, state: Tensors) -> Aggregation:
    """The privacy chain of a run whose ``privacy`` section (checked) turns DP or secure
    sums on."""
    p, dp = cfg.privacy, dp_on(cfg)
    client_noise = dp and p.noise == "client"
    settings = SumSettings(
        multiplier=p.noise_multiplier, clip=p.clip, proto_clip=p.proto_clip,
        clients=cfg.clients.per_round, client_noise=client_noise,
        scale=p.secagg_max_weight if p.secagg and not dp else 1.0)
    form = SumForm(alg, flatten(alg.broadcast(state)), settings)
    chosen: list[PrivacyLayer] = []
    if dp and p.adaptive_clip:
        if not form.weights:
            raise ProtoflError(f"privacy.adaptive_clip adapts the clip norm of the weights "
                               f"update, but {alg.name} uploads no weights")
        adaptive = AdaptiveClip(p.clip, p.target_quantile, p.clip_lr, clip_count_std(cfg),
                                p.noise_multiplier, cfg.clients.per_round, cfg.seed,
                                p.reproducible_noise)
        chosen.append(adaptive)
        form = adaptive.plan_form(form)
    chosen.append(ClientClip(cfg.seed, p.secagg_range if p.secagg else None,
                             p.reproducible_noise, client_noise)
                  if p.secagg or client_noise else ServerClip())
    chosen.append(Sum())
    if dp:
        chosen.append(GaussianNoise("client" if client_noise else "server", cfg.seed,
                                    p.reproducible_noise))
    chosen.append(Estimate())
    if not dp:
        return chain(*chosen, alg=alg, form=form)
    planned = effective_multiplier([m for layer in chosen for m in layer.plan(form)])
    if planned < MIN_MULTIPLIER:
        raise ProtoflError(
            f"privacy.noise_multiplier = {p.noise_multiplier:g} leaves each round a noise "
            f"multiplier of {planned:.3g} (below {MIN_MULTIPLIER}), where epsilon is "
            "beyond any use; raise it, or set 0 to turn DP off")
    accountant = Accountant(planned, num_clients, cfg.clients.per_round, p.delta,
                            p.sampling, p.accountant)
    budget = None
    if p.budget is not None:
        budget = Budget(accountant, p.budget, p.on_budget)
        first = accountant.epsilon(1)
        if p.on_budget == "stop" and first > p.budget:
            raise ProtoflError(f"privacy.budget = {p.budget:g} is below the epsilon of one "
                               f"round ({first:.3g} at delta {p.delta:g}); raise it or "
                               "privacy.noise_multiplier")
    if alg.fallback and p.noise == "server":
        log.warning("privacy: %s: %s", alg.name, alg.fallback)
    chosen.append(Accounting(accountant, budget, p.reproducible_noise))
    return chain(*chosen, alg=alg, form=form)


def clip_count_std(cfg: Config) -> float:
    """sigma_b: ``privacy.clip_count_std``, or K'/20 (Andrew et al.'s suggestion)."""
    std = cfg.privacy.clip_count_std
    return cfg.clients.per_round / 20 if std is None else std


def stack(cfg: Config, alg: Algorithm, num_clients: int, state: Tensors) -> Aggregation:
    """The run's aggregation: plain, or the privacy chain its ``privacy`` section asks for
    (checked against the algorithm first: one line for what is not covered)."""
    check(cfg, alg)
    if not dp_on(cfg) and not cfg.privacy.secagg:
        return Aggregation(alg)
    return layers(cfg, alg, num_clients, state)
