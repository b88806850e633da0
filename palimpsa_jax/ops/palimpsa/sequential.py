"""Palimpsa as a `lax.scan` over time in the linear form; float32 state."""

import jax
import jax.numpy as jnp

from palimpsa_jax.ops.linear_form import readout


def palimpsa_sequential(q, k, v, beta, gate, prior_precision, m0, ibar0, *, return_variance,
                        chunk_size=None):
  """One step per token. Shapes as in linear_form; chunk_size is unused."""
  del chunk_size
  ip = prior_precision[None, :, None, None]

  def step(carry, x):
    m, ibar = carry
    q_t, k_t, v_t, beta_t, a_t = x  # [B,H,K], [B,H,K], [B,H,V], [B,H,V], [B,H]
    a = a_t[..., None, None]
    m = a * m + v_t[..., :, None] * k_t[..., None, :]
    ibar = a * ibar + beta_t[..., :, None] * (k_t * k_t)[..., None, :]
    return (m, ibar), readout(m, ibar, ip, q_t, return_variance)

  time_major = lambda x: jnp.moveaxis(x, 1, 0)
  xs = tuple(map(time_major, (q, k, v, beta, gate)))
  (m, ibar), (out, var) = jax.lax.scan(step, (m0, ibar0), xs)
  var = None if var is None else time_major(var)
  return time_major(out), var, m, ibar
