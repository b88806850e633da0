"""`simple_gla`: the public op. Validates, builds the initial state and the segment starts,
dispatches to an implementation of the table in implementations.py."""

import jax
import jax.numpy as jnp

from palimpsa_jax.ops import dispatch
from palimpsa_jax.ops.common import segment_starts
from palimpsa_jax.ops.simple_gla.implementations import IMPLEMENTATIONS, PREFERENCE
from palimpsa_jax.ops.simple_gla.types import SimpleGLAResult
from palimpsa_jax.ops.simple_gla.validation import validate_gla_args


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
) -> SimpleGLAResult:
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
    SimpleGLAResult(out [B, T, H, V] in v's dtype, state [B, H, V, K] float32).
  """
  batch, time, heads, key_dim, value_dim = validate_gla_args(
      q, k, v, log_alpha, initial_state, segment_ids, implementation, chunk_size)
  f32 = jnp.float32
  q, k, v_f, log_alpha = (x.astype(f32) for x in (q, k, v, log_alpha))
  state_shape = (batch, heads, value_dim, key_dim)
  h0 = jnp.zeros(state_shape, f32) if initial_state is None else initial_state.astype(f32)
  starts = segment_starts(segment_ids, batch, time)
  out, state = dispatch.run(IMPLEMENTATIONS, implementation, PREFERENCE,
                            (q, k, v_f, log_alpha, h0, starts), dict(chunk_size=chunk_size))
  return SimpleGLAResult(out.astype(v.dtype), state)
