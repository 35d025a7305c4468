"""The optional capabilities of an algorithm, declared by inheriting (and implementing) them.

The core (``base.Algorithm``) is what every method has: state, broadcast, client begin /
loss / end, aggregate, its upload's description and prediction. The rest of protofl asks
an algorithm for more only through the functions below, which test for these classes:

- :class:`Sums`: the server rule is a ratio of sums over clients, so client-level DP and
  secure aggregation can feed it a (noised, secure) sum instead of the uploads;
- :class:`Prototypes`: uploads carry class prototypes (AMM and the feature analyses read
  them instead of computing class means from an uploaded model);
- :class:`Personalized`: every client keeps its own model and is scored with it; the server
  holds no global model (such a method may train different models per client).

A method without ``Sums`` is refused by DP and secure aggregation with the reason in its
class attribute ``individual_reason`` (why its server needs each client's upload).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from protofl.algorithms.base import Algorithm, Tensors, Weights

INDIVIDUAL = "its server rule needs each client's upload"


class Sums:
    """Capability: client k's aggregation weight depends on its own upload and the server
    state only (``client_weight``), and the next state follows from the round's aggregate
    shaped as one upload (``aggregate_private``), so sums over clients suffice."""

    # what ``aggregate_private`` computes instead of the exact rule, when it differs (logged
    # under server-side DP; "" when the estimate feeds the exact rule)
    fallback: ClassVar[str] = ""

    def client_weight(self, upload: Tensors, state: Tensors | None) -> torch.Tensor:
        """Client k's unnormalised weight ``w_k`` (FedAvg: ``n_k``; ``state`` is None on a
        client)."""
        return upload["num_samples"].to(torch.float64)

    def client_weight_bound(self) -> float | None:
        """The largest ``client_weight`` can be; None when unbounded (``n_k``), which DP
        replaces by uniform weights."""
        return None

    def sums_reason(self) -> str:
        """Why the server still needs each upload individually at these options ("" when
        sums do: secure aggregation and client-side noise need "")."""
        from protofl.algorithms.base import KINDS

        for key, entry in self.upload_spec().items():  # type: ignore[attr-defined]
            if entry.kind in ("score", "other"):
                return f"its server reads {key!r} of each client ({KINDS[entry.kind]})"
        return ""

    def aggregate_private(self, state: Tensors, mean: Tensors, round: int
                          ) -> tuple[Tensors, Tensors]:
        """New state from the round's aggregate shaped as one upload (the averaged weights,
        the averaged prototypes, their total counts): ``aggregate`` of that one upload."""
        return self.aggregate(state, [mean], round)  # type: ignore[attr-defined]


class Prototypes:
    """Capability: uploads carry class prototypes ``protos (C, d)`` and ``counts (C,)``."""

    def prototypes(self, upload: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
        """The class prototypes and class counts the upload holds."""
        return upload["protos"], upload["counts"]


class Personalized:
    """Capability: every client keeps its own model (from the broadcast's common ``init`` the
    first time) and is scored with it; uploads hold no weights, the server no model."""

    def global_weights(self, state: Tensors) -> Weights | None:
        return None

    def client_weights(self, upload: Tensors) -> Weights | None:
        return None

    def local_start(self, broadcast: Tensors, client_state: Tensors) -> Weights:
        own = client_state if "params" in client_state else broadcast["init"]
        return {"params": own["params"], "buffers": own["buffers"]}

    def eval_weights(self, state: Tensors, client_state: Tensors) -> Weights | None:
        if "params" in client_state:
            return {"params": client_state["params"], "buffers": client_state["buffers"]}
        return self.local_start(self.broadcast(state), client_state)  # type: ignore


def sums(alg: Algorithm) -> bool:
    return isinstance(alg, Sums)


def personalized(alg: Algorithm | type) -> bool:
    cls = alg if isinstance(alg, type) else type(alg)
    return issubclass(cls, Personalized)


def sums_reason(alg: Algorithm) -> str:
    """Why ``alg``'s server needs each client's upload individually ("" when sums do)."""
    if isinstance(alg, Sums):
        return alg.sums_reason()
    return alg.individual_reason or INDIVIDUAL


def prototypes(alg: Algorithm, upload: Tensors,
               data: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """The class prototypes ``(C, d)`` and counts ``(C,)`` an upload stands for: those it
    holds (:class:`Prototypes`), else the class means of the uploaded model's features on
    the client's data ``x, y = data()`` (loaded only then); none (all counts 0) when the upload
    holds neither (a personalised method sharing logits or a head)."""
    from protofl.algorithms.base import class_prototypes

    if isinstance(alg, Prototypes):
        return alg.prototypes(upload)
    w = alg.client_weights(upload)
    if w is None:
        c = alg.num_classes
        return torch.zeros(c, alg.model.feature_dim), torch.zeros(c)
    return class_prototypes(alg.model, w["params"], w["buffers"], *data(), alg.num_classes)
