"""Per-layer summary statistics returned by mixers when asked."""

import jax
import jax.numpy as jnp

from palimpsa_jax.ops import PalimpsaResult


def rms(x: jax.Array) -> jax.Array:
  x = x.astype(jnp.float32)
  return jnp.sqrt(jnp.mean(x * x))


def gate_diagnostics(log_alpha: jax.Array) -> dict[str, jax.Array]:
  """Forget-gate summary from log_alpha [B, T, H]."""
  return {"log_alpha_mean": jnp.mean(log_alpha.astype(jnp.float32))}


def palimpsa_diagnostics(
    result: PalimpsaResult, q: jax.Array, prior_precision: jax.Array,
    y: jax.Array) -> dict[str, jax.Array]:
  """Predictive variance and precision-state summaries, all f32 scalars.

  variance: the op's sum_k q^2 / I_t [B, T, H, V] (for beta = 0, where the op
  may skip it, sum_k q^2 / Ip). metaplastic_fraction: fraction of final
  precision entries above twice the prior.
  """
  variance = result.variance
  if variance is None:
    q2 = jnp.sum(jnp.square(q.astype(jnp.float32)), axis=-1)  # [B, T, H]
    variance = (q2 / prior_precision)[..., None]
  precision = result.state.precision
  ip = prior_precision.astype(jnp.float32)[None, :, None, None]
  return {
      "variance_mean": jnp.mean(variance),
      "variance_std": jnp.std(variance),
      "precision_mean": jnp.mean(precision),
      "precision_std": jnp.std(precision),
      "metaplastic_fraction": jnp.mean(
          (precision > 2.0 * ip).astype(jnp.float32)),
      "output_rms": rms(y),
  }
