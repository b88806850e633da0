"""Step-by-step MesaNet with an exact solve per step: one lax.scan over time.

Runs in the dtype it is given; in float64 it is the reference the chunked form is tested against.
"""

from jax import lax
import jax.numpy as jnp

_HIGHEST = lax.Precision.HIGHEST


def mesa_sequential(q, k, v, beta, log_gamma, lam, h0, g0, starts):
  """H_t = g H + b k k^T, G_t = g G + b v k^T, out_t = G_t (H_t + diag lam)^{-1} q_t.

  Args:
    q, k: [B, T, H, K].
    v: [B, T, H, V].
    beta, log_gamma: [B, T, H] input gate and log forget gate.
    lam: [H, K] regulariser (positive).
    h0: [B, H, K, K] and g0: [B, H, V, K] states before step 0.
    starts: [B, T] bool, True where both states restart from zero before the step.

  Returns:
    (out [B, T, H, V], final H [B, H, K, K], final G [B, H, V, K]).
  """
  ridge = lam[..., :, None] * jnp.eye(lam.shape[-1], dtype=lam.dtype)  # [H, K, K]

  def step(carry, xs):
    h, g = carry
    q_t, k_t, v_t, beta_t, log_g_t, start_t = xs
    gate = jnp.where(start_t[:, None], 0.0, jnp.exp(log_g_t))[..., None, None]
    bk = beta_t[..., None] * k_t
    h = gate * h + bk[..., :, None] * k_t[..., None, :]
    g = gate * g + v_t[..., :, None] * bk[..., None, :]
    x = jnp.linalg.solve(h + ridge, q_t[..., None])[..., 0]
    return (h, g), jnp.einsum("bhvk,bhk->bhv", g, x, precision=_HIGHEST)

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, beta, log_gamma, starts))
  (h, g), out = lax.scan(step, (h0, g0), xs)
  return jnp.moveaxis(out, 0, 1), h, g
