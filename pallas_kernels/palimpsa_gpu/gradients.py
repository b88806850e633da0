"""The backward's last stage: gradients in the caller's layout, dlog_alpha's chunk sums.

XLA computes the adjoint carries' contributions as matmuls (the carry is constant inside
a chunk). One Pallas kernel per (batch*head, chunk) then adds them to the backward
walk's chunk-local gradients, sums the walk's V-tile groups, forms every step's
dlog_alpha term with its segment-wise reverse sum inside the chunk, and writes dq, dk,
dv, dbeta as [B, Tp, H, D] in the inputs' dtype. `finish_dlog_alpha` adds the later
chunks' part of dlog_alpha (a scan over chunks in XLA).
(Matmuls inside this kernel were slower: RESULTS.md run 12.)
"""

import functools
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.common import largest_power_of_two_dividing, next_power_of_two

_MAX_TILE = 128  # Widest [chunk, width] tile over V and over K.


def _tiles(size: int, cap: int) -> list[tuple[int, int]]:
  """(start, width) tiles covering [0, size) with power-of-two widths <= cap.

  One tile from 0 if size rounds up to a power of two <= cap (masked past size: Pallas
  takes a masked slice past the end only from start 0), else equal tiles dividing size.
  """
  if next_power_of_two(size) <= cap:
    return [(0, next_power_of_two(size))]
  width = min(largest_power_of_two_dividing(size), cap)
  return [(start, width) for start in range(0, size, width)]


def _in_bounds(start: int, width: int, limit: int):
  """Mask [1, width] of columns < limit; None if all are."""
  if start + width <= limit:
    return None
  return (start + jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)) < limit


def _read(ref, cols, lead=()):
  """ref[*lead, :, cols] as float32, zero past the ref's last extent (cols: (start, width))."""
  mask = _in_bounds(*cols, ref.shape[-1])
  view = ref.at[lead + (slice(None), pl.ds(*cols))]  # One indexer (Triton lowering).
  if mask is None:
    return view[...].astype(jnp.float32)
  if lead:
    raise ValueError("masked reads take no leading index")
  return plgpu_triton.load(view, mask=mask, other=0).astype(jnp.float32)


def _write(ref, cols, value):
  """ref[:, cols] = value in ref's dtype, up to the ref's last extent."""
  mask, view = _in_bounds(*cols, ref.shape[-1]), ref.at[:, pl.ds(*cols)]
  value = value.astype(ref.dtype)
  if mask is None:
    view[...] = value
  else:
    plgpu_triton.store(view, value, mask=mask)


def _segmented_reverse_sum(x, reset):
  """y_t = sum of x_u over t <= u < (next restart after t), inside one chunk.

  x, reset: [C] float32 (reset 1.0 where a segment restarts). Also returns whether t
  is in the chunk's last segment (no restart in (t, C)). Done as [C, C] masked sums.
  """
  c = x.shape[0]
  row = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
  restarts = jnp.sum(jnp.where(col <= row, reset[None, :], 0.0), axis=1)  # up to t
  same_segment = restarts[None, :] == restarts[:, None]
  y = jnp.sum(jnp.where((col >= row) & same_segment, x[None, :], 0.0), axis=1)
  return y, restarts == jnp.sum(reset)


def _gradients_kernel(k_ref, v_ref, beta_ref, w_ref, reset_ref, ip_ref, dq_ref, dk_ref,
                      dv_ref, dbeta_ref, s_ref, extra_ref, cv_ref, cbeta_ref, ckm_ref,
                      ckb_ref, dq_out, dk_out, dv_out, dbeta_out, dla_out, tail_out, *,
                      k_width, groups):
  # K tiles stay within the inputs' width: reads with a group index cannot be masked.
  k_tiles = _tiles(k_width, min(_MAX_TILE, k_ref.shape[-1]))
  w = w_ref[...][:, None]

  def group_sum(ref, cols):
    return functools.reduce(operator.add,
                            [_read(ref, cols, lead=(g,)) for g in range(groups)])

  for kt in k_tiles:
    _write(dq_out, kt, group_sum(dq_ref, kt))
    dk = group_sum(dk_ref, kt) + w * (
        _read(ckm_ref, kt) + 2.0 * _read(k_ref, kt) * _read(ckb_ref, kt))
    _write(dk_out, kt, dk)
  # dL/dlog a_t's per-step term (see op.py): -Ip s_t - v_t.dv_t - beta_t.dbeta_t + extra.
  # Reads are zero past Vp, so padded columns add nothing.
  s_sum = functools.reduce(operator.add, [s_ref[g, :] for g in range(groups)])
  m_term = extra_ref[...] - ip_ref[0] * s_sum
  for vt in _tiles(v_ref.shape[-1], _MAX_TILE):
    dv = _read(dv_ref, vt) + w * _read(cv_ref, vt)
    dbeta = _read(dbeta_ref, vt) + w * _read(cbeta_ref, vt)
    m_term -= (jnp.sum(_read(v_ref, vt) * dv, axis=1)
               + jnp.sum(_read(beta_ref, vt) * dbeta, axis=1))
    _write(dv_out, vt, dv)
    _write(dbeta_out, vt, dbeta)
  reset = reset_ref[...]
  y, in_last = _segmented_reverse_sum(m_term, reset)
  keep = reset == 0.0
  dla_out[...] = jnp.where(keep, y, 0.0)
  tail_out[...] = jnp.where(keep & in_last, 1.0, 0.0)


def assemble_gradients(k, v, beta, to_end, reset, ip_row, dq, dk, dv, dbeta, s, extra,
                       carry_v, carry_beta, carry_km, carry_kb, *, chunk: int, b: int,
                       h: int, k_width: int, dtypes, interpret: bool):
  """Gradients of q, k, v, beta in [B, Tp, H, D] and dlog_alpha's chunk-local sums.

  Args:
    k: [BH, Tp, Kw]; v, beta: [BH, Tp, Vp]; to_end: [BH, Tp] decay to the chunk end;
    reset: [BH, Tp] float32, 1.0 where a segment restarts; ip_row: [BH, Kw] prior
    precision.
    dq, dk: [G, BH, Tp, Kw]; dv, dbeta: [BH, Tp, Vp]; s: [G, BH, Tp]: the backward
    walk's chunk-local parts (G V-tile groups, summed here).
    extra: [BH, Tp] added to every step's dlog_alpha term (final state, variance).
    carry_v, carry_beta: [BH, Tp, Vp]: k carry_m^T and k^2 carry_b^T per step;
    carry_km, carry_kb: [BH, Tp, Kw]: v carry_m and beta carry_b per step (the carries'
    contributions before the decay to the chunk end).
    k_width: the K columns written out (<= Kw).
    dtypes: the dtypes of (dq, dk, dv, dbeta).

  Returns:
    dq, dk [B, Tp, H, k_width]; dv, dbeta [B, Tp, H, Vp]; dla_local [BH, Tp] (zero where
    a segment restarts) and in_tail [BH, Tp] (1.0 where the step's segment runs on to
    its chunk's end, else 0.0): see `finish_dlog_alpha`.
  """
  groups, bh, tp, kw = dq.shape
  vp = v.shape[-1]
  row_k = pl.BlockSpec((None, chunk, kw), lambda n, c: (n, c, 0))
  row_v = pl.BlockSpec((None, chunk, vp), lambda n, c: (n, c, 0))
  row = pl.BlockSpec((None, chunk), lambda n, c: (n, c))
  group_k = pl.BlockSpec((groups, None, chunk, kw), lambda n, c: (0, n, c, 0))
  group_row = pl.BlockSpec((groups, None, chunk), lambda n, c: (0, n, c))

  def caller(width):
    return pl.BlockSpec((None, chunk, None, width), lambda n, c: (n // h, c, n % h, 0))

  kernel = functools.partial(_gradients_kernel, k_width=k_width, groups=groups)
  params = None if interpret else plgpu_triton.CompilerParams(num_warps=4, num_stages=1)
  f32 = jnp.float32
  return pl.pallas_call(
      kernel, grid=(bh, tp // chunk),
      in_specs=[row_k, row_v, row_v, row, row,
                pl.BlockSpec((None, kw), lambda n, c: (n, 0)),
                group_k, group_k, row_v, row_v, group_row, row, row_v, row_v, row_k, row_k],
      out_specs=[caller(k_width), caller(k_width), caller(vp), caller(vp), row, row],
      out_shape=[jax.ShapeDtypeStruct((b, tp, h, k_width), dtypes[0]),
                 jax.ShapeDtypeStruct((b, tp, h, k_width), dtypes[1]),
                 jax.ShapeDtypeStruct((b, tp, h, vp), dtypes[2]),
                 jax.ShapeDtypeStruct((b, tp, h, vp), dtypes[3]),
                 jax.ShapeDtypeStruct((bh, tp), f32), jax.ShapeDtypeStruct((bh, tp), f32)],
      compiler_params=params, interpret=interpret, name="palimpsa_gradients",
  )(k, v, beta, to_end, reset, ip_row, dq, dk, dv, dbeta, s, extra, carry_v, carry_beta,
    carry_km, carry_kb)


def finish_dlog_alpha(dla_local, in_tail, reset, chunk: int) -> jax.Array:
  """dlog_alpha [BH, Tp]: the chunk-local sums plus what later chunks add.

  after_c, the sum over later chunks that chunk c's last segment runs into, is
  open_c * (head_{c+1} + through_{c+1} * after_{c+1}): open_c, no restart at chunk c+1's
  first step; through_c, none in chunk c after its first step; head_c, chunk c's
  leading-segment sum. A reverse scan over chunks.
  """
  bh, tp = dla_local.shape
  nc = tp // chunk
  restarts = reset.reshape(bh, nc, chunk)
  through = ~jnp.any(restarts[..., 1:], axis=-1)
  is_open = jnp.concatenate([~restarts[:, 1:, 0], jnp.zeros((bh, 1), bool)], axis=-1)
  shift = lambda z: jnp.concatenate([z[:, 1:], jnp.zeros_like(z[:, :1])], axis=-1)
  gain = jnp.where(is_open, shift(through.astype(jnp.float32)), 0.0)
  add = jnp.where(is_open, shift(dla_local[:, ::chunk]), 0.0)

  def compose(inner, outer):  # X -> add + gain X, the inner map applied first
    return outer[0] * inner[0], outer[1] + outer[0] * inner[1]

  _, after = jax.lax.associative_scan(compose, (gain, add), reverse=True, axis=1)
  return dla_local + in_tail * jnp.repeat(after, chunk, axis=-1)
