"""Scalar-gated linear attention (SimpleGLA; the Mamba2 / SSD recurrence).

Per batch element and head, with a_t = exp(log_alpha_t):

    h_t   = a_t * h_{t-1} + v_t k_t^T          (h: [V, K])
    out_t = h_t q_t

This is Palimpsa with beta = 0 and prior precision 1 (docs/math.md, special cases); `palimpsa(beta=None)`
divides by the prior precision itself. Shapes: q, k [B, T, H, K]; v [B, T, H, V];
log_alpha [B, T, H]; state [B, H, V, K] float32. All arithmetic runs in float32.
"""

from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

from palimpsa_jax.ops.common import (check_array, check_options, check_sequences, chunk_masks,
                                     pad_time, segment_starts, to_chunks)

IMPLEMENTATIONS = ("auto", "sequential", "chunked")
_HIGHEST = lax.Precision.HIGHEST


class GLAResult(NamedTuple):
  """What `simple_gla` returns.

  out:   [B, T, H, V], dtype of v: readout h_t q_t.
  state: [B, H, V, K] float32, h after the last step.
  """

  out: jax.Array
  state: jax.Array


def _sequential(q, k, v, log_alpha, h0, starts):
  """Step-by-step lax.scan over time; inputs float32, time-major inside."""

  def step(h, xs):
    q_t, k_t, v_t, log_a_t, start_t = xs
    a_t = jnp.where(start_t[:, None], 0.0, jnp.exp(log_a_t))  # [B, H]
    h = a_t[..., None, None] * h + v_t[..., :, None] * k_t[..., None, :]
    return h, jnp.einsum("bhvk,bhk->bhv", h, q_t, precision=_HIGHEST)

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, log_alpha, starts))
  state, out = lax.scan(step, h0, xs)
  return jnp.moveaxis(out, 0, 1), state


def _chunked(q, k, v, log_alpha, h0, starts, chunk_size):
  """Chunkwise form: decay-masked attention inside chunks, a scan over chunk states.

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


def simple_gla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    log_alpha: jax.Array,
    *,
    initial_state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    implementation: str = "auto",
    chunk_size: int = 64,
) -> GLAResult:
  """Scalar-gated linear attention h_t = a_t h_{t-1} + v_t k_t^T, out_t = h_t q_t.

  Args:
    q: [B, T, H, K] queries (no scale is applied).
    k: [B, T, H, K] keys.
    v: [B, T, H, V] values.
    log_alpha: [B, T, H] log forget gate, expected <= 0 (not checked: values may be traced).
    initial_state: [B, H, V, K] state before step 0; zeros if None.
    segment_ids: [B, T] integer ids of packed documents; where the id changes between t-1 and t
      the state restarts from zero before step t.
    implementation: "sequential" (scan over time), "chunked" (chunkwise matmul form) or "auto"
      (chunked).
    chunk_size: steps per chunk for "chunked"; any T works (the tail is padded).

  Returns:
    GLAResult(out [B, T, H, V] in v's dtype, state [B, H, V, K] float32).
  """
  batch, time, heads, key_dim, value_dim = check_sequences(q, k, v, initial_state, segment_ids)
  check_array("log_alpha", log_alpha, (batch, time, heads), "[B, T, H]")
  state_shape = (batch, heads, value_dim, key_dim)
  check_options(implementation, chunk_size, IMPLEMENTATIONS)

  f32 = jnp.float32
  q, k, v_f, log_alpha = (x.astype(f32) for x in (q, k, v, log_alpha))
  h0 = jnp.zeros(state_shape, f32) if initial_state is None else initial_state.astype(f32)
  starts = segment_starts(segment_ids, batch, time)
  if implementation == "sequential":
    out, state = _sequential(q, k, v_f, log_alpha, h0, starts)
  else:
    out, state = _chunked(q, k, v_f, log_alpha, h0, starts, chunk_size)
  return GLAResult(out.astype(v.dtype), state)
