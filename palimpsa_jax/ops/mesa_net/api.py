"""`mesa_net`: the public op. Validates, builds the initial state and the segment starts,
dispatches to an implementation of the table in implementations.py."""

import jax
import jax.numpy as jnp

from palimpsa_jax.ops import dispatch
from palimpsa_jax.ops.common import segment_starts
from palimpsa_jax.ops.mesa_net.implementations import IMPLEMENTATIONS, PREFERENCE
from palimpsa_jax.ops.mesa_net.types import MesaNetResult, MesaState
from palimpsa_jax.ops.mesa_net.validation import validate_mesa_args


def mesa_net(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    beta: jax.Array,
    log_gamma: jax.Array,
    lam: jax.Array,
    *,
    initial_state: MesaState | None = None,
    segment_ids: jax.Array | None = None,
    implementation: str = "auto",
    chunk_size: int = 64,
    cg_steps: int = 30,
) -> MesaNetResult:
  """MesaNet: out_t = G_t (H_t + diag lam)^{-1} q_t with

      H_t = gamma_t H_{t-1} + beta_t k_t k_t^T,   G_t = gamma_t G_{t-1} + beta_t v_t k_t^T,

  gamma_t = exp(log_gamma_t). G_t (H_t + diag lam)^{-1} is the ridge-regression fit of values on
  the gated past keys. lam must be positive (not checked: values may be traced); the system is
  then symmetric positive definite.

  Args:
    q: [B, T, H, K] queries (no scale is applied).
    k: [B, T, H, K] keys.
    v: [B, T, H, V] values.
    beta: [B, T, H] input gate, expected >= 0.
    log_gamma: [B, T, H] log forget gate, expected <= 0.
    lam: [H, K] regulariser per head and key channel.
    initial_state: MesaState before step 0; zeros if None.
    segment_ids: [B, T] integer ids of packed documents; where the id changes between t-1 and t
      both sums restart from zero before step t.
    implementation: "sequential" (scan over time, exact solve per step), "chunked" (chunkwise,
      `cg_steps` conjugate-gradient iterations per step) or "auto" (chunked).
    chunk_size: steps per chunk for "chunked"; any T works (the tail is padded).
    cg_steps: CG iterations for "chunked", from the diagonal solve q / (diag H_t + lam); 0 reads
      out with that diagonal solve, K or more is exact up to rounding.

  Returns:
    MesaNetResult(out [B, T, H, V] in v's dtype, state MesaState float32).
  """
  batch, time, heads, key_dim, value_dim = validate_mesa_args(
      q, k, v, beta, log_gamma, lam, initial_state, segment_ids, implementation, chunk_size,
      cg_steps)
  f32 = jnp.float32
  q, k, v_f, beta, log_gamma, lam = (
      x.astype(f32) for x in (q, k, v, beta, log_gamma, lam))
  if initial_state is None:
    h0 = jnp.zeros((batch, heads, key_dim, key_dim), f32)
    g0 = jnp.zeros((batch, heads, value_dim, key_dim), f32)
  else:
    h0, g0 = (x.astype(f32) for x in initial_state)
  starts = segment_starts(segment_ids, batch, time)
  out, h, g = dispatch.run(IMPLEMENTATIONS, implementation, PREFERENCE,
                           (q, k, v_f, beta, log_gamma, lam, h0, g0, starts),
                           dict(chunk_size=chunk_size, cg_steps=cg_steps))
  return MesaNetResult(out.astype(v.dtype), MesaState(h, g))
