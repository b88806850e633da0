"""Fast Palimpsa: the rank-1-precision approximation of the Palimpsa op, and its reference."""

from palimpsa_jax.ops.fast_palimpsa.api import fast_palimpsa
from palimpsa_jax.ops.fast_palimpsa.decode import (FastPalimpsaCache, fast_palimpsa_decode,
                                                   init_fast_palimpsa_cache)
from palimpsa_jax.ops.fast_palimpsa.reference import reference_fast_palimpsa

__all__ = ["FastPalimpsaCache", "fast_palimpsa", "fast_palimpsa_decode",
           "init_fast_palimpsa_cache", "reference_fast_palimpsa"]
