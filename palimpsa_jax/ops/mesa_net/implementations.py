"""MesaNet's implementations by name: one table, one contract, and the
order "auto" tries them in (ops.dispatch).

`mesa_net` runs the fn of an entry of IMPLEMENTATIONS as

    fn(q, k, v, beta, log_gamma, lam, h0, g0, starts, *, chunk_size, cg_steps)
    -> (out [B, T, H, V] float32, H [B, H, K, K] float32, G [B, H, V, K] float32)

on validated float32 arrays: q, k [B, T, H, K]; v [B, T, H, V]; beta, log_gamma [B, T, H];
lam [H, K]; (h0, g0) the sums before step 0; starts [B, T] bool (True where both sums
restart from zero before the step).
"""

from palimpsa_jax.ops.dispatch import ELSEWHERE, Implementation
from palimpsa_jax.ops.mesa_net.chunked import mesa_chunked
from palimpsa_jax.ops.mesa_net.sequential import mesa_sequential


def _sequential(q, k, v, beta, log_gamma, lam, h0, g0, starts, *, chunk_size, cg_steps):
  del chunk_size, cg_steps  # One step at a time, with an exact solve.
  return mesa_sequential(q, k, v, beta, log_gamma, lam, h0, g0, starts)


def _chunked(q, k, v, beta, log_gamma, lam, h0, g0, starts, *, chunk_size, cg_steps):
  return mesa_chunked(q, k, v, beta, log_gamma, lam, h0, g0, starts, chunk_size, cg_steps)


IMPLEMENTATIONS = {
    # lax.scan over time, an exact solve per step.
    "sequential": Implementation(_sequential),
    # Chunkwise sums, cg_steps conjugate-gradient steps per readout.
    "chunked": Implementation(_chunked),
}
# What "auto" runs, on every platform.
PREFERENCE = {ELSEWHERE: ("chunked",)}
