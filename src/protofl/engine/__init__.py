"""The engine: the round loop, the trainers and the run folder."""

from protofl.engine import cache as _cache

# torch's compile caches in protofl's cache folder unless chosen already; set on import,
# before anything of torch's compiler reads the variable (engine/cache.py)
_cache.use_torch_cache()
