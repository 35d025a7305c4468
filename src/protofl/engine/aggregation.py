"""Aggregation as a stack of layers around the algorithm's server rule, chosen once per run.

The round loop talks to one :class:`Aggregation` and never asks whether the run is private:

- ``client_hook()``: what a client makes of its upload before it leaves (None: nothing);
- ``reply_spec()``: what a valid reply holds (screens replies);
- ``aggregate(state, broadcast, replies, round)``: the next state and the metrics line's
  figures;
- ``after_round(record, round)``: figures of the round's release (epsilon), and
  ``stop_reason(round)``: why round ``round`` may not run ("" when it may);
- ``individual``: whether replies are the clients' own uploads (a metric that reads one
  client's upload needs it), ``noised``: whether the aggregate carries DP noise, and
  ``state_dict`` / ``load_state_dict`` (checkpointed).

:class:`Aggregation` itself is the algorithm's rule over the uploads. Client-level DP and
secure sums are the chain of pure layers of ``engine/private.py`` (contributions clipped on
the server or computed on the clients, their sum, the noise, the accountant), composed by
``private.chain`` as Optax chains transformations; ``private.stack(spec, ...)`` chooses the
run's aggregation once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from protofl.algorithms.base import Algorithm, Tensors, UploadEntry

if TYPE_CHECKING:
    from protofl.engine.train import RoundContext


class Aggregation:
    """The plain layer: the algorithm's own server rule over the clients' uploads."""

    individual = True
    noised = False  # whether the aggregate carries DP noise (a poor early model by design)
    private = False  # whether any privacy layer is on (DP or secure sums)
    client_noise = False  # whether clients add DP noise to what they send

    def __init__(self, alg: Algorithm):
        self.alg = alg

    def client_hook(self, noise_seed: int | None = None
                    ) -> Callable[[RoundContext, int, Tensors], Tensors] | None:
        """What a client makes of its upload before it leaves (None: nothing);
        ``noise_seed``: a node's own seed for its share of DP noise."""
        return None

    def reply_spec(self) -> dict[str, UploadEntry]:
        return self.alg.upload_spec()

    def aggregate(self, state: Tensors, broadcast: Tensors, replies: list[Tensors],
                  round: int) -> tuple[Tensors, dict[str, Any]]:
        return self.alg.aggregate(state, replies, round)

    def after_round(self, record: dict, round: int) -> None:
        pass

    def stop_reason(self, round: int) -> str:
        return ""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
