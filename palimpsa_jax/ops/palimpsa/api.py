"""`palimpsa`: the public op. Validates, builds the initial state and the segment starts,
dispatches to an implementation of the table in implementations.py."""

import jax
import jax.numpy as jnp

from palimpsa_jax.ops import context_parallel, dispatch
from palimpsa_jax.ops.common import segment_starts
from palimpsa_jax.ops.palimpsa.implementations import IMPLEMENTATIONS, PREFERENCE
from palimpsa_jax.ops.palimpsa.validation import validate_palimpsa_args
from palimpsa_jax.ops.palimpsa_contract import (PalimpsaResult, PalimpsaState,
                                                initial_mean_and_precision)
from palimpsa_jax.ops.simple_gla import implementations as simple_gla


def palimpsa(q, k, v, beta, log_alpha, prior_precision, *, initial_state=None, segment_ids=None,
             return_variance=False, implementation="auto", chunk_size=64,
             interpret=False) -> PalimpsaResult:
  """Palimpsa recurrence (docs/math.md), no scale applied.

  Args:
    q, k: [B, T, H, K] float.
    v: [B, T, H, V] float; the output has its dtype.
    beta: [B, T, H, V] float, >= 0; None means beta == 0: the cheaper SimpleGLA path when
      starting from the prior, the general path with beta = 0 from a given initial_state.
    log_alpha: [B, T, H] float, <= 0.
    prior_precision: [H] float, > 0.
    initial_state: PalimpsaState (mu, precision [B, H, V, K] f32) or None for the prior.
    segment_ids: [B, T] integers; the state restarts from the prior where the id changes.
    return_variance: also return sum_k q^2 / I_t, [B, T, H, V] f32.
    implementation: "auto", "sequential", "associative", "chunked", "pallas_gpu",
      "pallas_gpu_triton", "pallas_gpu_mosaic", "pallas_tpu".
      Inside ops.kernel_sharding with a sequence axis, each time shard runs it
      (ops.context_parallel).
      "auto" picks the kernel of the default backend and falls back to "chunked" where that
      kernel cannot run the call; a kernel named here raises ValueError instead.
      "pallas_gpu" runs each stage of the GPU kernel on Mosaic GPU where it can and on
      Triton elsewhere; "pallas_gpu_triton" and "pallas_gpu_mosaic" run every stage on
      that one Pallas backend.
    chunk_size: steps per chunk for the chunked forms. "pallas_gpu*" use min(chunk_size, T)
      rounded up to a power of two and clamped to [16, 128]; compiled "pallas_tpu" rounds it
      up to a multiple of 128.
    interpret: run a Pallas kernel in interpret mode.

  Returns:
    PalimpsaResult(out [B, T, H, V], variance or None, state after the last step).
  """
  validate_palimpsa_args(q, k, v, beta, log_alpha, prior_precision, initial_state,
                         segment_ids, implementation, chunk_size)
  ip = prior_precision.astype(jnp.float32)
  options = dict(return_variance=return_variance, implementation=implementation,
                 chunk_size=chunk_size, interpret=interpret)
  # The op computes as it does without a caller's default matmul precision (a model's
  # config.matmul_precision): its kernels choose their products' precision themselves.
  with jax.default_matmul_precision(None):
    if context_parallel.active() is not None:
      return _over_sequence(q, k, v, beta, log_alpha, ip, initial_state, segment_ids,
                            **options)
    return _whole_sequence(q, k, v, beta, log_alpha, ip, initial_state, segment_ids,
                           **options)


def _whole_sequence(q, k, v, beta, log_alpha, ip, initial_state, segment_ids, *,
                    return_variance, implementation, chunk_size, interpret) -> PalimpsaResult:
  """The op on arrays whose time axis is whole (validated arguments, ip f32)."""
  b, _, h, kd = q.shape
  vd = v.shape[-1]
  if beta is None and initial_state is None:
    return _simple_gla_path(q, k, v, log_alpha, ip, segment_ids, return_variance, implementation,
                            chunk_size)
  mu0, prec0 = initial_mean_and_precision(initial_state, ip, b, vd, kd)
  if beta is None:
    beta = jnp.zeros_like(v)

  starts = None if segment_ids is None else segment_starts(segment_ids, *segment_ids.shape)
  args = (q, k, v, beta, log_alpha, ip, mu0, prec0, starts)
  options = dict(return_variance=return_variance, chunk_size=chunk_size, interpret=interpret)
  out, var, mu, precision = dispatch.run(IMPLEMENTATIONS, implementation, PREFERENCE, args,
                                         options)
  return PalimpsaResult(out, var, PalimpsaState(mu, precision))


def _simple_gla_path(q, k, v, log_alpha, ip, segment_ids, return_variance, implementation,
                     chunk_size, h0=None) -> PalimpsaResult:
  """beta == 0 from the prior: I_t = Ip throughout, so out = (h q) / Ip with SimpleGLA's h.

  h0: [B, H, V, K] f32, SimpleGLA's state before step 0 (M = mu * Ip), None for zeros.
  (With a given initial_state its precision need not equal Ip, so beta=None then runs the
  general path with beta = 0.)
  """
  f32 = jnp.float32
  b, t, heads, kd = q.shape
  vd = v.shape[-1]
  if h0 is None:
    h0 = jnp.zeros((b, heads, vd, kd), f32)
  gla_impl = "sequential" if implementation == "sequential" else "auto"
  gla_args = (q.astype(f32), k.astype(f32), v.astype(f32), log_alpha.astype(f32), h0,
              segment_starts(segment_ids, b, t))
  gla_out, state = dispatch.run(simple_gla.IMPLEMENTATIONS, gla_impl, simple_gla.PREFERENCE,
                                gla_args, dict(chunk_size=chunk_size))
  inv_ip = 1.0 / ip
  out = (gla_out * inv_ip[:, None]).astype(v.dtype)
  var = None
  if return_variance:
    q2 = jnp.sum(jnp.square(q.astype(f32)), axis=-1, keepdims=True)  # [B,T,H,1]
    var = jnp.broadcast_to(q2 * inv_ip[:, None], out.shape)
  precision = jnp.broadcast_to(ip[None, :, None, None], state.shape)
  return PalimpsaResult(out, var, PalimpsaState(state * inv_ip[None, :, None, None], precision))


def _over_sequence(q, k, v, beta, log_alpha, ip, initial_state, segment_ids, *,
                   return_variance, implementation, chunk_size, interpret) -> PalimpsaResult:
  """The op with time split over the sequence axis (ops.context_parallel).

  Each shard runs _whole_sequence from its true start state; beta=None from the prior stays
  on the SimpleGLA path (the state is then M alone: I = Ip throughout).
  """
  b, _, h, kd = q.shape
  vd = v.shape[-1]
  ipb = ip[None, :, None, None]
  simple = beta is None and initial_state is None
  if initial_state is None:
    m0 = jnp.zeros((b, h, vd, kd), jnp.float32)
    ibar0 = None if simple else jnp.zeros_like(m0)
  else:
    prec0 = initial_state.precision.astype(jnp.float32)
    m0, ibar0 = initial_state.mu.astype(jnp.float32) * prec0, prec0 - ipb
  if beta is None and not simple:
    beta = jnp.zeros_like(v)
  options = dict(return_variance=return_variance, implementation=implementation,
                 chunk_size=chunk_size)

  def local(q, k, v, beta, log_alpha, ip, seg, m_in, ibar_in):
    if ibar_in is None:
      result = _simple_gla_path(q, k, v, log_alpha, ip, seg, return_variance, implementation,
                                chunk_size, h0=m_in)
    else:
      prec = ibar_in + ip[None, :, None, None]
      result = _whole_sequence(q, k, v, beta, log_alpha, ip, PalimpsaState(m_in / prec, prec),
                               seg, interpret=interpret, **options)
    return result.out, result.variance

  out, var, m, ibar = context_parallel.palimpsa_over_sequence(
      local, q, k, v, beta, log_alpha, ip, m0, ibar0, segment_ids, return_variance)
  precision = jnp.broadcast_to(ipb, m.shape) if ibar is None else ibar + ipb
  return PalimpsaResult(out, var, PalimpsaState(m / precision, precision))


def auto_implementation() -> str:
  """What implementation="auto" tries first on this platform: its kernel, else "chunked"."""
  return dispatch.preferred(PREFERENCE)[0]
