"""Public gated delta rule op: validation and dispatch."""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from palimpsa_jax.ops.gated_delta.chunked import gated_delta_chunked
from palimpsa_jax.ops.gated_delta.sequential import gated_delta_sequential
from palimpsa_jax.ops.common import check_array, check_options, check_sequences, segment_starts

IMPLEMENTATIONS = ("auto", "sequential", "chunked")


class DeltaRuleResult(NamedTuple):
  """What `gated_delta_rule` returns.

  out:   [B, T, H, V], dtype of v: readout S_t q_t.
  state: [B, H, V, K] float32, S after the last step.
  """

  out: jax.Array
  state: jax.Array


def gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    beta: jax.Array,
    log_alpha: jax.Array,
    *,
    initial_state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    implementation: str = "auto",
    chunk_size: int = 64,
) -> DeltaRuleResult:
  """Gated delta rule S_t = a_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T.

  out_t = S_t q_t, a_t = exp(log_alpha_t). DeltaNet is log_alpha = 0. The recurrence is stable
  for L2-normalised keys and beta in [0, 2]; neither is enforced (values may be traced).

  Args:
    q: [B, T, H, K] queries (no scale is applied).
    k: [B, T, H, K] keys.
    v: [B, T, H, V] values.
    beta: [B, T, H] write strength per head and step.
    log_alpha: [B, T, H] log forget gate, expected <= 0.
    initial_state: [B, H, V, K] state before step 0; zeros if None.
    segment_ids: [B, T] integer ids of packed documents; where the id changes between t-1 and t
      the state restarts from zero before step t.
    implementation: "sequential" (scan over time), "chunked" (WY / UT-transform chunkwise form)
      or "auto" (chunked).
    chunk_size: steps per chunk for "chunked"; any T works (the tail is padded).

  Returns:
    DeltaRuleResult(out [B, T, H, V] in v's dtype, state [B, H, V, K] float32).
  """
  batch, time, heads, key_dim, value_dim = check_sequences(q, k, v, initial_state, segment_ids)
  check_array("beta", beta, (batch, time, heads), "[B, T, H]")
  check_array("log_alpha", log_alpha, (batch, time, heads), "[B, T, H]")
  state_shape = (batch, heads, value_dim, key_dim)
  check_options(implementation, chunk_size, IMPLEMENTATIONS)

  f32 = jnp.float32
  q, k, v_f, beta, log_alpha = (x.astype(f32) for x in (q, k, v, beta, log_alpha))
  s0 = jnp.zeros(state_shape, f32) if initial_state is None else initial_state.astype(f32)
  starts = segment_starts(segment_ids, batch, time)
  if implementation == "sequential":
    out, state = gated_delta_sequential(q, k, v_f, beta, log_alpha, s0, starts)
  else:
    out, state = gated_delta_chunked(q, k, v_f, beta, log_alpha, s0, starts, chunk_size)
  return DeltaRuleResult(out.astype(v.dtype), state)
