"""The gated delta rule's implementations by name: one table, one contract, and the
order "auto" tries them in (ops.dispatch).

`gated_delta_rule` runs the fn of an entry of IMPLEMENTATIONS as

    fn(q, k, v, beta, log_alpha, s0, starts, *, chunk_size)
    -> (out [B, T, H, V] float32, state [B, H, V, K] float32)

on validated float32 arrays: q, k [B, T, H, K]; v [B, T, H, V]; beta, log_alpha [B, T, H];
s0 [B, H, V, K] the state before step 0; starts [B, T] bool (True where the state restarts
from zero before the step).
"""

from palimpsa_jax.ops.dispatch import ELSEWHERE, Implementation
from palimpsa_jax.ops.gated_delta_rule.chunked import gated_delta_chunked
from palimpsa_jax.ops.gated_delta_rule.sequential import gated_delta_sequential


def _sequential(q, k, v, beta, log_alpha, s0, starts, *, chunk_size):
  del chunk_size  # One step at a time.
  return gated_delta_sequential(q, k, v, beta, log_alpha, s0, starts)


def _chunked(q, k, v, beta, log_alpha, s0, starts, *, chunk_size):
  return gated_delta_chunked(q, k, v, beta, log_alpha, s0, starts, chunk_size)


IMPLEMENTATIONS = {
    "sequential": Implementation(_sequential),  # lax.scan over time.
    "chunked": Implementation(_chunked),  # The WY / UT-transform chunkwise form.
}
# What "auto" runs, on every platform.
PREFERENCE = {ELSEWHERE: ("chunked",)}
