"""Step-by-step gated delta rule: one lax.scan over time."""

from jax import lax
import jax.numpy as jnp

_HIGHEST = lax.Precision.HIGHEST


def gated_delta_sequential(q, k, v, beta, log_alpha, s0, starts):
  """S_t = a_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T; out_t = S_t q_t.

  Args:
    q, k: [B, T, H, K] float32.
    v: [B, T, H, V] float32.
    beta, log_alpha: [B, T, H] float32.
    s0: [B, H, V, K] float32 initial state.
    starts: [B, T] bool, True where the state restarts from zero before the step.

  Returns:
    (out [B, T, H, V] float32, final state [B, H, V, K] float32).
  """

  def step(s, xs):
    q_t, k_t, v_t, beta_t, log_a_t, start_t = xs
    s = jnp.where(start_t[:, None], 0.0, jnp.exp(log_a_t))[..., None, None] * s
    prediction = jnp.einsum("bhvk,bhk->bhv", s, k_t, precision=_HIGHEST)
    s = s + (beta_t[..., None] * (v_t - prediction))[..., :, None] * k_t[..., None, :]
    return s, jnp.einsum("bhvk,bhk->bhv", s, q_t, precision=_HIGHEST)

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, beta, log_alpha, starts))
  state, out = lax.scan(step, s0, xs)
  return jnp.moveaxis(out, 0, 1), state
