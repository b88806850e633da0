"""SimpleGLA's implementations by name: one table, one contract, and the
order "auto" tries them in (ops.dispatch).

`simple_gla` runs the fn of an entry of IMPLEMENTATIONS as

    fn(q, k, v, log_alpha, h0, starts, *, chunk_size)
    -> (out [B, T, H, V] float32, state [B, H, V, K] float32)

on validated float32 arrays: q, k [B, T, H, K]; v [B, T, H, V]; log_alpha [B, T, H];
h0 [B, H, V, K] the state before step 0; starts [B, T] bool (True where the state restarts
from zero before the step).
"""

from palimpsa_jax.ops.dispatch import ELSEWHERE, Implementation
from palimpsa_jax.ops.simple_gla.chunked import gla_chunked
from palimpsa_jax.ops.simple_gla.sequential import gla_sequential


def _sequential(q, k, v, log_alpha, h0, starts, *, chunk_size):
  del chunk_size  # One step at a time.
  return gla_sequential(q, k, v, log_alpha, h0, starts)


def _chunked(q, k, v, log_alpha, h0, starts, *, chunk_size):
  return gla_chunked(q, k, v, log_alpha, h0, starts, chunk_size)


IMPLEMENTATIONS = {
    "sequential": Implementation(_sequential),  # lax.scan over time.
    "chunked": Implementation(_chunked),  # Matmuls inside chunks, a scan over chunk states.
}
# What "auto" runs, on every platform.
PREFERENCE = {ELSEWHERE: ("chunked",)}
