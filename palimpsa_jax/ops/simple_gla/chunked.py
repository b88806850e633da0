"""Chunkwise SimpleGLA: decay-masked attention inside chunks, a scan over chunk states."""

from jax import lax
import jax.numpy as jnp

from palimpsa_jax.ops.common import chunk_masks, pad_time, to_chunks

_HIGHEST = lax.Precision.HIGHEST


def gla_chunked(q, k, v, log_alpha, h0, starts, chunk_size):
  """The chunkwise form on float32 inputs; returns (out [B, T, H, V], state [B, H, V, K]).

  Padding steps have k = v = 0 and log_alpha = 0, so they leave the state unchanged.
  """
  batch, time, heads, _ = q.shape
  size = min(chunk_size, time)
  qc, kc, vc = (to_chunks(pad_time(x, size), size) for x in (q, k, v))  # [B, N, H, C, .]
  log_a = to_chunks(pad_time(log_alpha, size), size)  # [B, N, H, C]
  start = pad_time(starts, size).reshape(batch, -1, size)  # [B, N, C]
  decay, from_start, to_end = chunk_masks(log_a, start)

  scores = jnp.einsum("bnhik,bnhjk->bnhij", qc, kc, precision=_HIGHEST) * decay
  out_intra = jnp.einsum("bnhij,bnhjv->bnhiv", scores, vc, precision=_HIGHEST)
  increments = jnp.einsum(
      "bnhjv,bnhjk->bnhvk", vc * to_end[..., None], kc, precision=_HIGHEST)

  def step(h, xs):
    chunk_decay, increment = xs
    return chunk_decay[..., None, None] * h + increment, h

  state, h_starts = lax.scan(
      step, h0, (jnp.moveaxis(from_start[..., -1], 1, 0), jnp.moveaxis(increments, 1, 0)))
  h_starts = jnp.moveaxis(h_starts, 0, 1)  # [B, N, H, V, K]
  out_inter = jnp.einsum("bnhvk,bnhik->bnhiv", h_starts, qc, precision=_HIGHEST)
  out = out_intra + from_start[..., None] * out_inter  # [B, N, H, C, V]
  out = jnp.moveaxis(out, 3, 2).reshape(batch, -1, heads, out.shape[-1])
  return out[:, :time], state
