"""When a run has diverged, and what to tell the user.

NaN/Inf is caught where it appears (``engine/experiment.py``). A loss can also explode while
staying finite (``clients.lr = 1e6`` on digits: a test loss of 2·10⁵ at chance accuracy); the
rule here stops such a run: an evaluated cross-entropy of the aggregate model (the global-test
``loss`` or the ``train_loss`` sample) above ``EXPLODED`` times ln C, the cross-entropy of a
uniform guess over the C classes (230 for 10 classes, 69 for 2). A healthy model's
cross-entropy stays within a few ln C (every training loss in docs/results.md is below
2.3, under 1 ln C). The rule is off under client-level DP (``privacy.noise_multiplier`` >
0), whose noise can make an early aggregate that poor by design (fedmargin on Synthetic at
noise 4: a test loss of 422 after round 1); there NaN/Inf alone stops a run.
"""

from __future__ import annotations

import math

from protofl.config import ClientConfig
from protofl.errors import Diverged

EXPLODED = 100.0  # times ln(num_classes)
LOSSES = ("loss", "train_loss")  # evaluated cross-entropies of the aggregate model


def explosion_bound(num_classes: int) -> float:
    """The cross-entropy above which a run is stopped as diverged."""
    return EXPLODED * math.log(max(num_classes, 2))


def remedy(c: ClientConfig) -> str:
    """The likely cause of a diverged run, as advice: a weight decay whose product with the
    learning rate is at least 1 (each SGD step scales the weights by 1 - lr·wd, so beyond 2
    they grow geometrically) or beyond 1e6 (its squared gradients overflow float32 in Adam);
    else the learning rate."""
    wd, lr = c.weight_decay or 0.0, c.lr or 0.0
    if wd and (wd * lr >= 1 or wd >= 1e6):
        return (f"clients.weight_decay = {wd:g} is the likely cause (lr·weight_decay = "
                f"{wd * lr:g}); lower it")
    return f"lower clients.lr (now {lr:g})"


def check_loss(record: dict, num_classes: int, c: ClientConfig, noised: bool = False) -> None:
    """Raise :class:`Diverged` when an evaluated loss of ``record`` (a round's) exploded
    (never when the aggregate is ``noised`` for DP)."""
    if noised:
        return
    bound = explosion_bound(num_classes)
    for key in LOSSES:
        v = record.get(key)
        if isinstance(v, float) and v > bound:  # NaN compares False; inf exploded
            raise Diverged(f"round {record['round']}: the {key.replace('_', ' ')} of the "
                           f"aggregate model exploded to {v:.3g} (above {EXPLODED:g}·ln "
                           f"{num_classes} = {bound:.3g}), so the run stopped; {remedy(c)}")
