"""Shared pieces of the linear form M = mu * I, Ibar = I - Ip (docs/math.md).

Every XLA implementation takes float32 inputs in the op's layout and a gate a_t = alpha_t that is
already 0 where a segment restarts (restarting from the prior is M = 0, Ibar = 0), and returns
(out [B,T,H,V] f32, variance [B,T,H,V] f32 or None, M_T [B,H,V,K], Ibar_T [B,H,V,K]).
"""

import jax
import jax.numpy as jnp

from palimpsa_jax.ops.common import segment_starts


def gate_from(log_alpha: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
  """alpha_t [B,T,H] f32, zeroed at the steps where segment_ids changes from t-1 to t."""
  a = jnp.exp(log_alpha.astype(jnp.float32))
  if segment_ids is None:
    return a
  starts = segment_starts(segment_ids, *segment_ids.shape)  # [B, T]
  return jnp.where(starts[:, :, None], 0.0, a)


def readout(m: jax.Array, ibar: jax.Array, ip: jax.Array, q: jax.Array, return_variance: bool
            ) -> tuple[jax.Array, jax.Array | None]:
  """out[v] = sum_k (M/I)[v,k] q[k], var[v] = sum_k q[k]^2 / I[v,k]; m, ibar [...,V,K], q [...,K].

  ip broadcasts against m ([..., 1, 1]).
  """
  r = 1.0 / (ibar + ip)
  out = jnp.sum(m * r * q[..., None, :], axis=-1)
  var = jnp.sum(r * (q * q)[..., None, :], axis=-1) if return_variance else None
  return out, var
