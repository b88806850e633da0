"""Shared pieces of the linear form M = mu * I, Ibar = I - Ip (docs/math.md).

Every XLA implementation takes float32 inputs in the op's layout, a gate a_t = alpha_t [B,T,H]
that is already 0 where a segment restarts (restarting from the prior is M = 0, Ibar = 0) and
the state (M_0, Ibar_0) [B,H,V,K], and returns (out [B,T,H,V] f32, variance [B,T,H,V] f32 or
None, M_T [B,H,V,K], Ibar_T [B,H,V,K]); implementations.py puts them behind the op's contract.
"""

import jax
import jax.numpy as jnp


def readout(m: jax.Array, ibar: jax.Array, ip: jax.Array, q: jax.Array, return_variance: bool
            ) -> tuple[jax.Array, jax.Array | None]:
  """out[v] = sum_k (M/I)[v,k] q[k], var[v] = sum_k q[k]^2 / I[v,k]; m, ibar [...,V,K], q [...,K].

  ip broadcasts against m ([..., 1, 1]).
  """
  r = 1.0 / (ibar + ip)
  out = jnp.sum(m * r * q[..., None, :], axis=-1)
  var = jnp.sum(r * (q * q)[..., None, :], axis=-1) if return_variance else None
  return out, var
