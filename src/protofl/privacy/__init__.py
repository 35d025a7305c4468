"""Privacy of what clients upload: client-level differential privacy (clipping, Gaussian noise,
accounting). Pure functions over tensors; nothing here knows the engine. See docs/privacy.md."""

from protofl.privacy.clip import clip, clip_prototypes, l2_norm
from protofl.privacy.noise import client_noise_std, distributed_multiplier, effective_multiplier

__all__ = ["clip", "clip_prototypes", "client_noise_std", "distributed_multiplier",
           "effective_multiplier", "l2_norm"]
