"""Shared pieces of the linear form M = mu * I, Ibar = I - Ip (docs/math.md), used by the XLA
forms of `palimpsa` and `fast_palimpsa`.

Every XLA implementation of Palimpsa takes float32 inputs in the op's layout, a gate
a_t = alpha_t [B,T,H] that is already 0 where a segment restarts (restarting from the prior is
M = 0, Ibar = 0) and the state (M_0, Ibar_0) [B,H,V,K], and returns (out [B,T,H,V] f32,
variance [B,T,H,V] f32 or None, M_T [B,H,V,K], Ibar_T [B,H,V,K]);
ops/palimpsa/implementations.py puts them behind the op's contract.
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


def scan_chunk_states(chunk_decay: jax.Array, dm: jax.Array, dibar: jax.Array, m0: jax.Array,
                      ibar0: jax.Array) -> tuple[tuple[jax.Array, jax.Array],
                                                 tuple[jax.Array, jax.Array]]:
  """The state entering every chunk, from each chunk's decay and writes.

  chunk_decay [N, ...] (the chunk's product of gates); dm, dibar [N, ..., V, K] (the chunk's
  decay-weighted writes); (m0, ibar0) [..., V, K] the state before the first chunk.
  Returns ((m_starts, ibar_starts) [N, ..., V, K], (m_final, ibar_final) [..., V, K]).
  """

  def step(state, x):
    m, ibar = state
    p, dm_n, dibar_n = x
    p = p[..., None, None]
    return (p * m + dm_n, p * ibar + dibar_n), state

  final, starts = jax.lax.scan(step, (m0, ibar0), (chunk_decay, dm, dibar))
  return starts, final
