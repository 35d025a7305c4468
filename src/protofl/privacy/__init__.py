"""Privacy of what clients upload: client-level differential privacy (clipping, Gaussian noise,
accounting). Pure functions over tensors; nothing here knows the engine. See docs/privacy.md."""

from protofl.privacy.clip import clip, clip_prototypes, l2_norm, prototypes_from_sums, weights_delta
from protofl.privacy.noise import (
    add_client_noise,
    client_noise_std,
    distributed_multiplier,
    effective_multiplier,
    noisy_sum,
    private_average,
)

__all__ = ["add_client_noise", "clip", "clip_prototypes", "client_noise_std",
           "distributed_multiplier", "effective_multiplier", "l2_norm", "noisy_sum",
           "private_average", "prototypes_from_sums", "weights_delta"]
