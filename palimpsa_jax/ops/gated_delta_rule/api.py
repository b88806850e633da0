"""`gated_delta_rule`: the public op. Validates, builds the initial state and the segment
starts, dispatches to an implementation of the table in implementations.py."""

import jax
import jax.numpy as jnp

from palimpsa_jax.ops import dispatch
from palimpsa_jax.ops.common import segment_starts
from palimpsa_jax.ops.gated_delta_rule.implementations import IMPLEMENTATIONS, PREFERENCE
from palimpsa_jax.ops.gated_delta_rule.types import GatedDeltaRuleResult
from palimpsa_jax.ops.gated_delta_rule.validation import validate_gated_delta_args


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
) -> GatedDeltaRuleResult:
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
    GatedDeltaRuleResult(out [B, T, H, V] in v's dtype, state [B, H, V, K] float32).
  """
  batch, time, heads, key_dim, value_dim = validate_gated_delta_args(
      q, k, v, beta, log_alpha, initial_state, segment_ids, implementation, chunk_size)
  f32 = jnp.float32
  q, k, v_f, beta, log_alpha = (x.astype(f32) for x in (q, k, v, beta, log_alpha))
  state_shape = (batch, heads, value_dim, key_dim)
  s0 = jnp.zeros(state_shape, f32) if initial_state is None else initial_state.astype(f32)
  starts = segment_starts(segment_ids, batch, time)
  out, state = dispatch.run(IMPLEMENTATIONS, implementation, PREFERENCE,
                            (q, k, v_f, beta, log_alpha, s0, starts), dict(chunk_size=chunk_size))
  return GatedDeltaRuleResult(out.astype(v.dtype), state)
