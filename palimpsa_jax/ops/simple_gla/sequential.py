"""Step-by-step SimpleGLA: one lax.scan over time."""

from jax import lax
import jax.numpy as jnp

_HIGHEST = lax.Precision.HIGHEST


def gla_sequential(q, k, v, log_alpha, h0, starts):
  """h_t = a_t h_{t-1} + v_t k_t^T, out_t = h_t q_t; float32 inputs, time-major inside.

  Returns (out [B, T, H, V] float32, final state [B, H, V, K] float32).
  """

  def step(h, xs):
    q_t, k_t, v_t, log_a_t, start_t = xs
    a_t = jnp.where(start_t[:, None], 0.0, jnp.exp(log_a_t))  # [B, H]
    h = a_t[..., None, None] * h + v_t[..., :, None] * k_t[..., None, :]
    return h, jnp.einsum("bhvk,bhk->bhv", h, q_t, precision=_HIGHEST)

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, log_alpha, starts))
  state, out = lax.scan(step, h0, xs)
  return jnp.moveaxis(out, 0, 1), state
