"""Fast Palimpsa's "pallas_gpu" implementation: Mosaic GPU chunk states and chunk reads.

Forward: the exact chunk-boundary states by the Mosaic GPU boundary kernel
(pallas_kernels/fast_palimpsa_gpu), then every chunk's reads from its entering state. With
bfloat16 inputs the reads are one fused Mosaic GPU kernel per direction (`_forward_fused`,
pallas_kernels/fast_palimpsa_gpu/reads.py: bfloat16 operands on tensor cores, float32
accumulation); otherwise (float32 inputs, whose tolerance bfloat16 operands cannot meet, or
tiles that do not fit) batched float32 matmuls (`_forward`, chunked.chunk_reads, the XLA
form's own). Backward (a custom VJP that saves only the inputs, never the [B, H, T/C, V, K]
states): the forward is recomputed, boundary kernel included, and differentiated: the fused
reads by their backward kernel, the states by their own VJP, which walks the adjoint carries
with the Mosaic GPU carries kernel.
"""

import functools

import jax
import jax.numpy as jnp

from palimpsa_jax.ops.common import chunk_masks
from palimpsa_jax.ops.fast_palimpsa.chunked import chunk_reads
import pallas_kernels.fast_palimpsa_gpu as kernels
from pallas_kernels.common import round_up

f32 = jnp.float32


def fast_palimpsa_gpu(q, k, v, beta, log_alpha, prior_precision, initial_mu, initial_precision,
                      segment_starts, *, return_variance: bool, chunk_size: int,
                      interpret: bool = False, read_tiles=None):
  """Fast Palimpsa (docs/fast_palimpsa.md) with Mosaic GPU chunk states and reads.

  Args:
    q, k: [B, T, H, K]; v, beta: [B, T, H, V] (float32 or bfloat16).
    log_alpha: [B, T, H]; prior_precision: [H] float32.
    initial_mu, initial_precision: [B, H, V, K] float32, the state before step 0.
    segment_starts: [B, T] bool (the state restarts from the prior there) or None.
    return_variance: also return the approximation's predictive variance.
    chunk_size: C, 16, 32, 64 or 128. interpret: run the kernels interpreted (CPU).
    read_tiles: (ForwardTiles, BackwardTiles) of the fused read kernels, default theirs
      (`reads.default_tiles`); for the tuning benchmark.

  Returns:
    out [B, T, H, V] dtype of v, variance [B, T, H, V] float32 or None, and the exact
    state after the last step: mu, precision [B, H, V, K] float32.

  Raises:
    NotImplementedError: the state kernels cannot run this call (`check_supported`).
  """
  kernels.check_supported(k, v, beta, chunk_size, interpret)
  try:
    reads = kernels.reads_call(q, k, v, beta, chunk=chunk_size, with_var=return_variance,
                               interpret=interpret, tiles=read_tiles)
  except NotImplementedError:
    if read_tiles is not None:
      raise
    reads = None  # The reads as XLA matmuls (float32 calls, or tiles that do not fit).
  b, t = q.shape[:2]
  starts = jnp.zeros((b, t), bool) if segment_starts is None else segment_starts
  out, var, m, ibar = _recomputed(reads, return_variance, chunk_size, interpret, q, k, v,
                                  beta, log_alpha, prior_precision, initial_mu,
                                  initial_precision, starts)
  precision = ibar + prior_precision[None, :, None, None]
  return out.astype(v.dtype), var, m / precision, precision


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _recomputed(reads, return_variance, chunk, interpret, *args):
  """`_forward` (or `_forward_fused` with reads), whose backward recomputes it from the
  inputs (the only residuals)."""
  return _run(reads, return_variance, chunk, interpret)(*args)


def _run(reads, return_variance, chunk, interpret):
  if reads is None:
    return functools.partial(_forward, return_variance=return_variance, chunk=chunk,
                             interpret=interpret)
  return functools.partial(_forward_fused, reads=reads, interpret=interpret)


def _recomputed_fwd(reads, return_variance, chunk, interpret, *args):
  return _recomputed(reads, return_variance, chunk, interpret, *args), args


def _recomputed_bwd(reads, return_variance, chunk, interpret, args, cotangents):
  # jax.checkpoint would do this too, but not around interpreted kernels (their callbacks
  # are effects, which checkpoint refuses).
  run = _run(reads, return_variance, chunk, interpret)
  _, vjp = jax.vjp(lambda *floats: run(*floats, args[-1]), *args[:-1])
  return (*vjp(cotangents), None)  # No cotangent for the segment starts.


_recomputed.defvjp(_recomputed_fwd, _recomputed_bwd)


def _padded_rows(x, tp: int, width: int):
  """[B, T, H, D] -> [B, Tp, H, width], zero padding (neutral steps)."""
  return jnp.pad(x, ((0, 0), (0, tp - x.shape[1]), (0, 0), (0, width - x.shape[-1])))


def _states(k_rows, v_rows, beta_rows, to_end, chunk_gate, prior_precision, initial_mu,
            initial_precision, chunk, interpret):
  """The linear-form states (M, Ibar) entering every chunk [BH, NC, Vp, Kp] and after the
  last [BH, Vp, Kp], by the boundary kernel (`kernels.chunk_states`).

  k_rows [B, Tp, H, Kp], v_rows, beta_rows [B, Tp, H, Vp]; to_end [B, Tp, H]; chunk_gate
  [B, NC, H]; initial_mu, initial_precision [B, H, V, K].
  """
  b, _, h, kp = k_rows.shape
  vp = v_rows.shape[-1]
  vd, kd = initial_mu.shape[-2:]
  head_major = lambda x: jnp.moveaxis(x, 2, 1).reshape(b * h, x.shape[1])
  ipb = prior_precision[None, :, None, None]
  state_pad = ((0, 0), (0, 0), (0, vp - vd), (0, kp - kd))
  m0 = jnp.pad(initial_mu * initial_precision, state_pad).reshape(b * h, vp, kp)
  b0 = jnp.pad(initial_precision - ipb, state_pad).reshape(b * h, vp, kp)
  return kernels.chunk_states(k_rows, v_rows, beta_rows, head_major(to_end),
                              head_major(chunk_gate), m0, b0, h, chunk, interpret)


def _forward_fused(q, k, v, beta, log_alpha, prior_precision, initial_mu, initial_precision,
                   starts, *, reads, interpret):
  """(out [B, T, H, V] v's dtype, variance or None, M_T, Ibar_T [B, H, V, K]) with the
  fused read kernels (pallas_kernels/fast_palimpsa_gpu/reads.py): everything but the
  kernels is per-step or per-chunk XLA work, differentiated by JAX."""
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  chunk = reads.chunk
  tp = round_up(t, reads.forward.rows)  # Whole CTAs of rows (neutral steps, sliced off).
  kp, vp = round_up(kd, 16), round_up(vd, 16)
  k_rows, v_rows, beta_rows = (_padded_rows(x, tp, w) for x, w in ((k, kp), (v, vp),
                                                                    (beta, vp)))
  log_alpha = jnp.pad(log_alpha.astype(f32), ((0, 0), (0, tp - t), (0, 0)))
  g, ids, from_start, to_end = kernels.step_gates(
      log_alpha, jnp.pad(starts, ((0, 0), (0, tp - t))), chunk)
  m_starts, b_starts, m_final, b_final = _states(
      k_rows, v_rows, beta_rows, to_end, from_start[:, chunk - 1::chunk], prior_precision,
      initial_mu, initial_precision, chunk, interpret)
  ip = jnp.tile(prior_precision, b)  # [B*H]
  bk, bv, ps = kernels.chunk_start_terms(m_starts, b_starts, ip, kd, vd)
  mean_beta = jnp.sum(beta_rows.astype(f32), axis=-1) / vd
  step_rows = kernels.step_rows(g, ids, from_start, ps, prior_precision, mean_beta,
                                reads.forward.rows, chunk)
  out, var = kernels.fused_reads(_padded_rows(q, tp, kp), k_rows, v_rows, beta_rows,
                                 step_rows, bk, bv, m_starts, b_starts, ip, reads)
  final = lambda x: x[..., :vd, :kd].reshape(b, h, vd, kd)
  return (out[:, :t, :, :vd], None if var is None else var[:, :t, :, :vd], final(m_final),
          final(b_final))


def _forward(q, k, v, beta, log_alpha, prior_precision, initial_mu, initial_precision, starts,
             *, return_variance, chunk, interpret):
  """(out [B, T, H, V] f32, variance or None, M_T, Ibar_T [B, H, V, K]) with the reads as
  XLA's batched float32 matmuls (chunked.chunk_reads)."""
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  tp = round_up(t, chunk)
  n = tp // chunk
  kp, vp = round_up(kd, 16), round_up(vd, 16)

  def chunks(x):  # [B, Tp, H, ...] -> [B, N, H, C, ...] float32
    x = x.astype(f32).reshape((b, n, chunk) + x.shape[2:])
    return jnp.moveaxis(x, 2, 3)

  def from_head_major(x):  # [B*H, ..., Vp, Kp] -> [B, H, ..., V, K]
    return x[..., :vd, :kd].reshape((b, h) + x.shape[1:-2] + (vd, kd))

  # [B, N, H, C]; padding: gate 1
  log_alpha = chunks(_padded_rows(log_alpha[..., None], tp, 1))[..., 0]
  decay, from_start, to_end = chunk_masks(
      log_alpha, jnp.pad(starts, ((0, 0), (0, tp - t))).reshape(b, n, chunk))
  m_starts, b_starts, m_final, b_final = _states(
      _padded_rows(k, tp, kp), _padded_rows(v, tp, vp), _padded_rows(beta, tp, vp),
      jnp.moveaxis(to_end, 3, 2).reshape(b, tp, h), from_start[..., -1], prior_precision,
      initial_mu, initial_precision, chunk, interpret)
  m_c, b_c = (jnp.moveaxis(from_head_major(s), 2, 1) for s in (m_starts, b_starts))
  out, var = chunk_reads(
      *(chunks(_padded_rows(x, tp, x.shape[-1])) for x in (q, k, v, beta)), decay, from_start,
      m_c, b_c, prior_precision, return_variance=return_variance,
      precision=kernels.dot_precision(interpret))

  def unchunk(y):  # [B, N, H, C, V] -> [B, T, H, V]
    return jnp.moveaxis(y, 3, 2).reshape(b, tp, h, vd)[:, :t]

  return (unchunk(out), None if var is None else unchunk(var), from_head_major(m_final),
          from_head_major(b_final))
