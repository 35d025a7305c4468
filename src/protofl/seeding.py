"""Seeded generators keyed by purpose: every random choice of a run is drawn from a generator
made from ``(seed, purpose, round[, client])``, so a round's choices do not depend on the order
clients are trained in, on the trainer, or on whether the run was resumed."""

from __future__ import annotations

import numpy as np
import torch

# purposes (the second key of every generator)
SAMPLE, STRAGGLE, ORDER, AUGMENT, PROBE, SERVER = range(6)  # SERVER: server-side training
NOISE, CLIENT_NOISE = 6, 7  # DP noise added by the server / by a client
CLIP_NOISE = 8  # DP noise on adaptive clipping's count of unclipped updates
DROP = 9  # which sampled clients drop out of a round (clients.dropout)
VALIDATION = 10  # which training rows each client holds out (data.validation_fraction)
HOOK = 11  # an algorithm's own draws in its client hooks (ClientRound.generator)


def np_rng(seed: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([seed, *keys])


def torch_gen(seed: int, *keys: int) -> torch.Generator:
    state = np.random.SeedSequence([seed, *keys]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
