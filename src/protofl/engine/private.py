"""Client-level differential privacy and secure sums in the round loop (docs/privacy.md).

:meth:`PrivateRounds.build` checks the ``privacy`` section against the algorithm (one line
for what is not covered) and returns None when it is off. Otherwise the round loop

- gives trainers :meth:`client_hook` when the clients compute their contributions themselves
  (client-side noise, secure aggregation): an upload becomes the client's contribution
  (``privacy.contrib.SumForm``) before it leaves the client;
- screens replies against :meth:`spec`;
- aggregates with :meth:`aggregate`: the contributions (computed here from the raw uploads for
  server-side noise), their sum, the server's noise (the OS's CSPRNG; with
  ``privacy.reproducible_noise``, tests only, a generator keyed by (seed, NOISE, round)), the
  estimate, and the algorithm's ``aggregate_private``;
- logs ``epsilon`` (at ``delta``) every round and asks the budget before the next round.

Nothing here names an algorithm's upload key: ``UploadEntry.kind`` says what each entry is.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from protofl.algorithms.base import Algorithm, Tensors, UploadEntry
from protofl.config import Config
from protofl.errors import ProtoflError
from protofl.nested import flatten
from protofl.privacy.accountant import Accountant, Budget
from protofl.privacy.contrib import SumForm, SumSettings
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
    if alg.centralized:
        raise ProtoflError(f"privacy: {alg.name} trains on the pooled data of every client; "
                           "client-level DP and secure aggregation do not apply to it")
    if cfg.metrics.ffd_reference and (p.secagg or p.noise == "client"):
        raise ProtoflError("metrics.ffd_reference compares each client's model with the "
                           "reference, but under privacy.secagg or privacy.noise: client the "
                           "server holds only sums; leave one of them out")
    reason = alg.sums_reason()
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
    # server-side noise: the server may score raw uploads (bounded client weights), but a
    # rule that needs each upload for more than a weight is refused unless it has a fallback
    others = [k for k, e in alg.upload_spec().items() if e.kind == "other"]
    if (alg.needs_individual or others) and not alg.private_fallback:
        why = alg.needs_individual or f"its server reads {others[0]!r} of each client"
        raise ProtoflError(f"privacy: {alg.name} cannot be trained with client-level DP: {why}")
    if cfg.clients.sampling == "weighted":
        raise ProtoflError("privacy: clients.sampling = weighted picks clients by their data "
                           "size, which no DP accountant covers; set clients.sampling: uniform")


class PrivateRounds:
    """The ``privacy`` section of one run, wired into its rounds."""

    def __init__(self, cfg: Config, alg: Algorithm, num_clients: int, state: Tensors):
        p = cfg.privacy
        self.alg, self.seed = alg, cfg.seed
        self.reproducible = p.reproducible_noise  # noise from the seed: tests only
        self.dp = dp_on(cfg)
        self.client_noise = self.dp and p.noise == "client"
        self.from_clients = p.secagg or self.client_noise
        self.settings = SumSettings(
            multiplier=p.noise_multiplier, clip=p.clip, proto_clip=p.proto_clip,
            clients=cfg.clients.per_round, client_noise=self.client_noise,
            scale=p.secagg_max_weight if p.secagg and not self.dp else 1.0)
        self.form = SumForm(alg, flatten(alg.broadcast(state)), self.settings)
        self.multipliers: list[float] = []  # one per round that released an aggregate
        self.accountant = self.budget = None
        self.client_secret: int | None = None  # a node's own seed for its noise (Flower)
        if self.dp:
            if self.form.multiplier() < MIN_MULTIPLIER:
                raise ProtoflError(
                    f"privacy.noise_multiplier = {p.noise_multiplier:g} leaves each round a "
                    f"noise multiplier of {self.form.multiplier():.3g} (below "
                    f"{MIN_MULTIPLIER}), where epsilon is beyond any use; raise it, or set 0 "
                    "to turn DP off")
            self.accountant = Accountant(self.form.multiplier(), num_clients,
                                         cfg.clients.per_round, p.delta, p.sampling,
                                         p.accountant)
            if p.budget is not None:
                self.budget = Budget(self.accountant, p.budget, p.on_budget)
                first = self.accountant.epsilon(1)
                if p.on_budget == "stop" and first > p.budget:
                    raise ProtoflError(f"privacy.budget = {p.budget:g} is below the epsilon of "
                                       f"one round ({first:.3g} at delta {p.delta:g}); raise "
                                       "it or privacy.noise_multiplier")
            if alg.private_fallback and p.noise == "server":
                log.warning("privacy: %s: %s", alg.name, alg.private_fallback)

    @classmethod
    def build(cls, cfg: Config, alg: Algorithm, num_clients: int, state: Tensors
              ) -> PrivateRounds | None:
        check(cfg, alg)
        if not dp_on(cfg) and not cfg.privacy.secagg:
            return None
        return cls(cfg, alg, num_clients, state)

    # ---- clients ----
    def client_hook(self, rc: RoundContext, client: int, upload: Tensors) -> Tensors:
        """A client's upload as the contribution it sends (with its share of the noise)."""
        gen = None
        if self.client_noise:
            seed = self.seed if self.client_secret is None else self.client_secret
            gen = noise_source(self.reproducible, seed, CLIENT_NOISE, rc.round, client)
        return self.form.contribution(upload, rc.broadcast, None, gen)[0]

    def spec(self) -> dict[str, UploadEntry]:
        """What a valid reply holds: a contribution (clients compute them) or an upload."""
        return self.form.spec() if self.from_clients else self.alg.upload_spec()

    # ---- server ----
    def aggregate(self, state: Tensors, broadcast: Tensors, uploads: list[Tensors], round: int
                  ) -> tuple[Tensors, dict[str, Any]]:
        """The next state from the round's valid replies, and the metrics line's figures."""
        diag: dict[str, Any] = {}
        if self.from_clients:
            contributions = uploads
        else:
            pairs = [self.form.contribution(u, broadcast, state) for u in uploads]
            contributions = [c for c, _ in pairs]
            if self.form.weights:
                w = np.array([float(c["weight"]) for c in contributions])
                diag["weights"] = (w / w.sum() if w.sum() > 0 else w).tolist()
                if self.dp:
                    norms = [n for _, n in pairs]
                    diag["clipped"] = int(sum(n > self.settings.clip for n in norms))
                    diag["update_norm"] = float(np.median(norms))
        total = SumForm.total(contributions)
        received = float(total["members"])
        if self.dp and not self.client_noise:
            total = self.form.noised(total, noise_source(self.reproducible, self.seed, NOISE,
                                                         round))
        state, alg_diag = self.alg.aggregate_private(state, self.form.estimate(total, broadcast),
                                                     round)
        alg_diag.pop("weights", None)  # the estimate's one weight says nothing
        if self.dp:
            self.multipliers.append(self.form.multiplier(received))
        return state, {**alg_diag, **diag}

    def flags(self) -> dict[str, Any]:
        """What a metrics line says of the run's privacy: ``private: false`` when its DP
        noise can be regenerated from the seed (``privacy.reproducible_noise``)."""
        return {"private": False} if self.dp and self.reproducible else {}

    def epsilon(self) -> float:
        """Epsilon at ``delta`` after the rounds so far."""
        return self.accountant.epsilon_of(self.multipliers) if self.accountant else 0.0

    def allows(self, round: int) -> bool:
        """Whether round ``round`` may run under the budget (at full noise)."""
        if self.budget is None:
            return True
        eps = self.accountant.epsilon_of([*self.multipliers, self.form.multiplier()])
        return self.budget.allows(round, eps)

    def state_dict(self) -> dict[str, Any]:
        return {"multipliers": list(self.multipliers)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.multipliers = [float(m) for m in state.get("multipliers", [])]
