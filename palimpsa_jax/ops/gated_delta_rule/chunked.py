"""Chunkwise gated delta rule (the WY / UT-transform form of Gated DeltaNet).

Inside a chunk of C steps with start state S_0 and gamma_t = exp(G_t) (G_t the cumulative
log-decay from the chunk start up to t), write S_t = gamma_t S_0 + sum_{j<=t} (gamma_t/gamma_j)
u_j k_j^T. The delta rule's corrections u_t = beta_t (v_t - a_t S_{t-1} k_t) then satisfy the unit
lower-triangular system

    (I + A) U = beta V - (beta gamma K) S_0^T,   A[t, j] = beta_t (gamma_t/gamma_j) k_t.k_j, j < t,

so U = U0 - W S_0^T with U0 = (I + A)^{-1} (beta V) and W = (I + A)^{-1} (beta gamma K), both
independent of S_0. Then

    out = gamma Q S_0^T + ((Q K^T) o D) U,   D[t, j] = gamma_t/gamma_j for j <= t,
    S_C = gamma_C S_0 + (U * gamma_C/gamma)^T K.

Only the last two lines need S_0: a lax.scan over chunks carries S and emits U per chunk; everything
else is batched over chunks. Segment resets zero the decay across a segment start (see
`palimpsa_jax.ops.common.chunk_masks`).
"""

import jax
from jax import lax
import jax.numpy as jnp
import jax.scipy.linalg

from palimpsa_jax.ops.common import chunk_masks, pad_time, to_chunks

_HIGHEST = lax.Precision.HIGHEST


def gated_delta_chunked(q, k, v, beta, log_alpha, s0, starts, chunk_size):
  """Chunked gated delta rule; same arguments and results as `gated_delta_sequential`.

  Padding steps have k = v = beta = 0 and log_alpha = 0, so they leave the state unchanged.
  """
  batch, time, heads, key_dim = q.shape
  size = min(chunk_size, time)
  qc, kc, vc = (to_chunks(pad_time(x, size), size) for x in (q, k, v))  # [B, N, H, C, .]
  beta_c, log_a = (to_chunks(pad_time(x, size), size) for x in (beta, log_alpha))  # [B, N, H, C]
  start = pad_time(starts, size).reshape(batch, -1, size)  # [B, N, C]
  decay, from_start, to_end = chunk_masks(log_a, start)

  gram = jnp.einsum("bnhik,bnhjk->bnhij", kc, kc, precision=_HIGHEST)
  strictly_lower = jnp.tril(jnp.ones((size, size), bool), -1)
  system = jnp.where(strictly_lower, beta_c[..., None] * decay * gram, 0.0)
  system = system + jnp.eye(size, dtype=system.dtype)
  rhs = jnp.concatenate(
      [(beta_c * from_start)[..., None] * kc, beta_c[..., None] * vc], axis=-1)
  solved = jax.scipy.linalg.solve_triangular(system, rhs, lower=True, unit_diagonal=True)
  w, u0 = solved[..., :key_dim], solved[..., key_dim:]
  k_to_end = to_end[..., None] * kc

  def step(s, xs):
    w_c, u0_c, k_end_c, chunk_decay = xs
    u = u0_c - jnp.einsum("bhck,bhvk->bhcv", w_c, s, precision=_HIGHEST)
    s_end = chunk_decay[..., None, None] * s + jnp.einsum(
        "bhcv,bhck->bhvk", u, k_end_c, precision=_HIGHEST)
    return s_end, (u, s)

  xs = (w, u0, k_to_end, from_start[..., -1])
  state, (u, s_starts) = lax.scan(step, s0, tuple(jnp.moveaxis(x, 1, 0) for x in xs))
  u, s_starts = jnp.moveaxis(u, 0, 1), jnp.moveaxis(s_starts, 0, 1)  # [B, N, H, C|V, V|K]

  scores = jnp.einsum("bnhik,bnhjk->bnhij", qc, kc, precision=_HIGHEST) * decay
  out = jnp.einsum("bnhij,bnhjv->bnhiv", scores, u, precision=_HIGHEST)
  out = out + from_start[..., None] * jnp.einsum(
      "bnhvk,bnhik->bnhiv", s_starts, qc, precision=_HIGHEST)
  out = jnp.moveaxis(out, 3, 2).reshape(batch, -1, heads, out.shape[-1])
  return out[:, :time], state
