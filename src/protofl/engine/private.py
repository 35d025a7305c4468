"""Client-level differential privacy and secure sums as aggregation layers (docs/privacy.md).

:func:`layers` stacks, around the algorithm's ``aggregate_private``:

- :class:`SumOfContributions`: the replies are contributions (``privacy.contrib.SumForm``);
  their sum, with the server's noise under server-side DP (:class:`ServerNoise`: from the
  OS's CSPRNG; with ``privacy.reproducible_noise``, tests only, from a generator keyed by
  (seed, NOISE, round)), becomes the estimate the algorithm reads;
- :class:`ServerContributions` (server-side noise): the clients send their raw uploads and
  the server clips them into contributions, or :class:`ClientContributions` (client-side
  noise, secure sums): each client computes its contribution, with its share of the noise,
  before it leaves (the layer's ``client_hook``);
- :class:`Accounting` (DP): ``epsilon`` (at ``delta``) after every round, and the budget
  asked before the next.

Nothing here names an algorithm's upload key: ``UploadEntry.kind`` says what each entry is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from protofl.algorithms.base import Algorithm, Tensors, UploadEntry
from protofl.algorithms.capabilities import sums, sums_reason
from protofl.config import Config
from protofl.engine.aggregation import Aggregation
from protofl.errors import ProtoflError
from protofl.nested import flatten
from protofl.privacy.accountant import Accountant, Budget
from protofl.privacy.contrib import SumForm, SumSettings, check_secure_range
from protofl.privacy.noise import noise_source
from protofl.seeding import CLIENT_NOISE, NOISE

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


class SumOfContributions(Aggregation):
    """Replies are contributions: their sum (noised by ``noise``, if any) becomes the
    estimate the algorithm's ``aggregate_private`` makes the next state from."""

    individual = False
    private = True

    def __init__(self, alg: Algorithm, form: SumForm, noise: ServerNoise | None = None):
        super().__init__(alg)
        self.form, self.noise = form, noise
        self.received = 0.0  # contributions in the last sum

    def reply_spec(self) -> dict[str, UploadEntry]:
        return self.form.spec()

    def aggregate(self, state, broadcast, replies, round):
        total = SumForm.total(replies)
        self.received = float(total["members"])
        if self.noise is not None:
            total = self.noise(total, round)
        state, diag = self.alg.aggregate_private(state, self.form.estimate(total, broadcast),
                                                 round)
        diag.pop("weights", None)  # the estimate's one weight says nothing
        return state, diag


class ServerNoise:
    """The server's Gaussian noise on a round's sum (server-side DP): from the operating
    system's CSPRNG, or with ``reproducible`` (tests only) from the run seed."""

    def __init__(self, form: SumForm, seed: int, reproducible: bool):
        self.form, self.seed, self.reproducible = form, seed, reproducible

    def __call__(self, total: Tensors, round: int) -> Tensors:
        return self.form.noised(total, noise_source(self.reproducible, self.seed, NOISE,
                                                    round))


class Layer(Aggregation):
    """A layer around ``inner``: everything it does not change is the inner layer's."""

    private = True

    def __init__(self, inner: Aggregation):
        super().__init__(inner.alg)
        self.inner = inner
        self.form: SumForm | None = getattr(inner, "form", None)

    @property
    def individual(self) -> bool:
        return self.inner.individual

    @property
    def noised(self) -> bool:
        return self.inner.noised

    @property
    def client_noise(self) -> bool:
        return self.inner.client_noise

    def client_hook(self, noise_seed: int | None = None):
        return self.inner.client_hook(noise_seed)

    def reply_spec(self):
        return self.inner.reply_spec()

    def aggregate(self, state, broadcast, replies, round):
        return self.inner.aggregate(state, broadcast, replies, round)

    def after_round(self, record, round):
        self.inner.after_round(record, round)

    def stop_reason(self, round):
        return self.inner.stop_reason(round)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)


class ServerContributions(Layer):
    """Clients send their raw uploads; the server makes each its (clipped) contribution and
    logs the client weights (and, under DP, how many updates were clipped)."""

    individual = True

    def __init__(self, inner: SumOfContributions, dp: bool):
        super().__init__(inner)
        self.dp = dp

    def reply_spec(self):
        return self.alg.upload_spec()

    def aggregate(self, state, broadcast, replies, round):
        pairs = [self.form.contribution(u, broadcast, state) for u in replies]
        diag: dict[str, Any] = {}
        if self.form.weights:
            w = np.array([float(c["weight"]) for c, _ in pairs])
            diag["weights"] = (w / w.sum() if w.sum() > 0 else w).tolist()
            if self.dp:
                norms = [n for _, n in pairs]
                diag["clipped"] = int(sum(n > self.form.settings.clip for n in norms))
                diag["update_norm"] = float(np.median(norms))
        state, alg_diag = self.inner.aggregate(state, broadcast, [c for c, _ in pairs], round)
        return state, {**alg_diag, **diag}


class ClientContributions(Layer):
    """Each client computes its contribution (with its share of the noise under client-side
    DP) before the upload leaves it; the replies are contributions."""

    def __init__(self, inner: SumOfContributions, seed: int, secure_range: float | None,
                 reproducible: bool):
        super().__init__(inner)
        self.seed, self.reproducible = seed, reproducible
        self.secure_range = secure_range  # secure sums: what SecAgg+ can carry

    @property
    def client_noise(self) -> bool:
        return self.form.settings.client_noise

    def client_hook(self, noise_seed: int | None = None
                    ) -> Callable[[RoundContext, int, Tensors], Tensors]:
        """The hook making an upload a contribution; client-side noise is drawn from the
        OS's CSPRNG, or with ``privacy.reproducible_noise`` (tests only) from ``noise_seed``
        (a node's own), else the run seed."""
        seed = self.seed if noise_seed is None else noise_seed

        def contribute(rc: RoundContext, client: int, upload: Tensors) -> Tensors:
            gen = noise_source(self.reproducible, seed, CLIENT_NOISE, rc.round,
                               client) if self.client_noise else None
            out = self.form.contribution(upload, rc.broadcast, None, gen)[0]
            if self.secure_range is not None:
                check_secure_range(out, self.form.spec(), self.secure_range, client)
            return out
        return contribute


class Accounting(Layer):
    """Client-level DP's accountant: ``epsilon`` after every round, and the budget."""

    def __init__(self, inner: Layer, core: SumOfContributions, accountant: Accountant,
                 budget: Budget | None, reproducible: bool):
        super().__init__(inner)
        self.core, self.accountant, self.budget = core, accountant, budget
        self.reproducible = reproducible
        self.multipliers: list[float] = []  # one per round that released an aggregate

    def aggregate(self, state, broadcast, replies, round):
        out = self.inner.aggregate(state, broadcast, replies, round)
        self.multipliers.append(self.core.form.multiplier(self.core.received))
        return out

    def after_round(self, record, round):
        self.inner.after_round(record, round)
        record["epsilon"] = self.epsilon()
        if self.reproducible:  # its noise can be regenerated from the seed
            record["private"] = False

    def epsilon(self) -> float:
        """Epsilon at ``delta`` after the rounds so far."""
        return self.accountant.epsilon_of(self.multipliers)

    @property
    def noised(self) -> bool:
        return True

    def stop_reason(self, round):
        """"privacy budget" when round ``round`` would exceed it (at full noise)."""
        if self.budget is None:
            return ""
        eps = self.accountant.epsilon_of([*self.multipliers, self.core.form.multiplier()])
        return "" if self.budget.allows(round, eps) else "privacy budget"

    def state_dict(self):
        return {"multipliers": list(self.multipliers)}

    def load_state_dict(self, state):
        self.multipliers = [float(m) for m in state.get("multipliers", [])]


def layers(cfg: Config, alg: Algorithm, num_clients: int, state: Tensors) -> Aggregation:
    """The privacy layers of a run whose ``privacy`` section (checked) turns DP or secure
    sums on."""
    p, dp = cfg.privacy, dp_on(cfg)
    client_noise = dp and p.noise == "client"
    settings = SumSettings(
        multiplier=p.noise_multiplier, clip=p.clip, proto_clip=p.proto_clip,
        clients=cfg.clients.per_round, client_noise=client_noise,
        scale=p.secagg_max_weight if p.secagg and not dp else 1.0)
    form = SumForm(alg, flatten(alg.broadcast(state)), settings)
    core = SumOfContributions(alg, form, ServerNoise(form, cfg.seed, p.reproducible_noise)
                              if dp and not client_noise else None)
    outer: Layer = (ClientContributions(core, cfg.seed, p.secagg_range if p.secagg else None,
                                        p.reproducible_noise)
                    if p.secagg or client_noise else ServerContributions(core, dp))
    if not dp:
        return outer
    if form.multiplier() < MIN_MULTIPLIER:
        raise ProtoflError(
            f"privacy.noise_multiplier = {p.noise_multiplier:g} leaves each round a noise "
            f"multiplier of {form.multiplier():.3g} (below {MIN_MULTIPLIER}), where epsilon is "
            "beyond any use; raise it, or set 0 to turn DP off")
    accountant = Accountant(form.multiplier(), num_clients, cfg.clients.per_round, p.delta,
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
    return Accounting(outer, core, accountant, budget, p.reproducible_noise)
