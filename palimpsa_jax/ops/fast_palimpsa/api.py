"""`fast_palimpsa`: the public op. Validates, builds the initial state and the segment starts,
dispatches to an implementation of the table in implementations.py."""

import jax.numpy as jnp

from palimpsa_jax.ops import context_parallel, dispatch
from palimpsa_jax.ops.common import segment_starts
from palimpsa_jax.ops.fast_palimpsa.implementations import IMPLEMENTATIONS, PREFERENCE
from palimpsa_jax.ops.fast_palimpsa.validation import validate_fast_palimpsa_args
from palimpsa_jax.ops.palimpsa_contract import (PalimpsaResult, PalimpsaState,
                                                initial_mean_and_precision)


def fast_palimpsa(q, k, v, beta, log_alpha, prior_precision, *, initial_state=None,
                  segment_ids=None, return_variance=False, implementation="auto",
                  chunk_size=16, interpret=False) -> PalimpsaResult:
  """Fast Palimpsa: Palimpsa with a rank-1 precision inside each chunk (docs/fast_palimpsa.md).

  An approximation of `palimpsa`, not an implementation of it: inside a chunk of chunk_size
  steps the precision read by the output is Ibar_V[t, v] * Ibar_K[t, k] / Ibar_S[t], built from
  marginals of the exact chunk-start state. The state carried from chunk to chunk, and returned,
  is exact. Chunks start at steps 0, C, 2C, ... of the call, so the output depends on
  chunk_size and on where the call starts. No scale is applied.

  Args:
    q, k: [B, T, H, K] float.
    v: [B, T, H, V] float; the output has its dtype.
    beta: [B, T, H, V] float, >= 0, or None for beta == 0.
    log_alpha: [B, T, H] float, <= 0.
    prior_precision: [H] float, > 0 (one prior per head: the rank-1 form needs a scalar prior).
    initial_state: PalimpsaState (mu, precision [B, H, V, K] f32) or None for the prior.
    segment_ids: [B, T] integers; where the id changes the state restarts from the prior, as
      if the gate were 0 at that step: the exact state, the marginals, the chunk's earlier
      writes and its start state are all cut off there.
    return_variance: also return (Ibar_S / Ibar_V) sum_k q^2 / Ibar_K, [B, T, H, V] f32.
    implementation: "auto" (the GPU kernel on an NVIDIA GPU where it takes the call, else
      "chunked"), "chunked" (matmuls in XLA), "pallas_gpu" (Mosaic GPU chunk states, Hopper;
      raises ValueError where it declines the call) or "sequential" (the literal loop).
    chunk_size: C, steps per chunk: part of the definition (C = 1 is not the exact op).
    interpret: run the Pallas kernel interpreted (CPU tests); XLA forms ignore it.

  Returns:
    PalimpsaResult(out [B, T, H, V], variance or None, exact state after the last step).
  """
  validate_fast_palimpsa_args(q, k, v, beta, log_alpha, prior_precision, initial_state,
                              segment_ids, implementation, chunk_size)
  if context_parallel.active() is not None:
    # Each shard would start its own chunk grid from the prior: refuse rather than differ.
    raise ValueError("fast_palimpsa cannot split the sequence over devices (a kernel_sharding "
                     "with a sequence axis is active); run it with the whole time axis")
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  ip = prior_precision.astype(jnp.float32)
  mu0, prec0 = initial_mean_and_precision(initial_state, ip, b, vd, kd)
  if beta is None:
    beta = jnp.zeros_like(v)
  starts = None if segment_ids is None else segment_starts(segment_ids, b, t)
  args = (q, k, v, beta, log_alpha, ip, mu0, prec0, starts)
  options = dict(return_variance=return_variance, chunk_size=chunk_size, interpret=interpret)
  out, var, mu, precision = dispatch.run(IMPLEMENTATIONS, implementation, PREFERENCE, args,
                                         options)
  return PalimpsaResult(out, var, PalimpsaState(mu, precision))
