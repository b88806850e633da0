"""Mamba2 / SSD in its quadratic "dual" form: a masked, attention-like matmul.

    Y = (L o (Q K^T)) V,   L[i, j] = exp(sum_{j < s <= i} log_alpha_s) for i >= j, else 0.

It materialises the [T, T] mask, so it is only for short sequences: an independent oracle for the
recurrent and chunked forms (SimpleGLA with a zero initial state), written without any scan.
"""

import jax
from jax import lax
import jax.numpy as jnp


def ssd_quadratic(q: jax.Array, k: jax.Array, v: jax.Array, log_alpha: jax.Array) -> jax.Array:
  """Computes the SSD output from a zero state.

  Args:
    q: [B, T, H, K] queries (the SSD's C).
    k: [B, T, H, K] keys (the SSD's B).
    v: [B, T, H, V] values (the SSD's x, input gate folded in).
    log_alpha: [B, T, H] log-decays (the SSD's A * dt, <= 0).

  Returns:
    [B, T, H, V] output in the dtype of the widest input.
  """
  cum = jnp.cumsum(log_alpha, axis=1)  # [B, T, H]
  segsum = cum[:, :, None, :] - cum[:, None, :, :]  # [B, T(i), T(j), H]
  time = q.shape[1]
  lower = jnp.tril(jnp.ones((time, time), bool))[None, :, :, None]
  mask = jnp.where(lower, jnp.exp(jnp.where(lower, segsum, 0.0)), 0.0)
  scores = jnp.einsum("bihk,bjhk->bijh", q, k, precision=lax.Precision.HIGHEST)
  return jnp.einsum("bijh,bjhv->bihv", mask * scores, v, precision=lax.Precision.HIGHEST)
