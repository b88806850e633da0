"""The backward's last stage: carry contributions, gradients in the caller's layout.

One Pallas kernel per (batch*head, chunk) adds the adjoint carries' contributions to
dv, dbeta and dk as tensor-core matmuls (the carry is constant inside a chunk), sums
the backward walk's V-tile groups, forms the dlog_alpha terms of every step with their
segment-wise reverse sum inside the chunk, and writes dq, dk, dv, dbeta as [B, Tp, H, D]
in the inputs' dtype. XLA then only adds the later chunks' part of dlog_alpha
(`finish_dlog_alpha`), on [B*H, Tp] rows.
"""

import functools
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.common import largest_power_of_two_dividing, next_power_of_two
from pallas_kernels.palimpsa_gpu import boundary

# Widest [chunk, width] tile over V and over K. Fewer, larger matmuls are faster (each
# is a round trip through shared memory) until the registers spill.
_MAX_TILE_V, _MAX_TILE_K = 128, 128


def _dot(x, y, contract, precision):
  """x [M, A] . y with `contract` = ((x axis,), (y axis,)); float32 out."""
  return jax.lax.dot_general(x, y, (contract, ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def _tiles(size: int, cap: int) -> list[tuple[int, int]]:
  """(start, width) tiles covering [0, size) with power-of-two widths <= cap.

  One tile from 0 if size rounds up to a power of two <= cap (masked past size: Pallas
  takes a masked slice past the end only from start 0), else equal tiles dividing size.
  """
  if next_power_of_two(size) <= cap:
    return [(0, next_power_of_two(size))]
  width = min(largest_power_of_two_dividing(size), cap)
  return [(start, width) for start in range(0, size, width)]


def _in_bounds(start: int, width: int, limit: int, axis: int):
  """Mask [1, width] (axis 1) or [width, 1] (axis 0) of indices < limit; None if all are."""
  if start + width <= limit:
    return None
  idx = start + jax.lax.broadcasted_iota(jnp.int32, (width,), 0)
  return jnp.expand_dims(idx < limit, 1 - axis)


def _read(ref, cols, rows=None, lead=()):
  """ref[*lead, rows, cols] as float32, zero past the ref's last two extents.

  cols, rows: (start, width) tiles (rows None: all rows).
  """
  masks = [_in_bounds(*cols, ref.shape[-1], 1)]
  if rows is not None:
    masks.append(_in_bounds(*rows, ref.shape[-2], 0))
  masks = [m for m in masks if m is not None]
  # One indexer: Pallas' Triton lowering loads through a single one.
  view = ref.at[lead + (slice(None) if rows is None else pl.ds(*rows), pl.ds(*cols))]
  if not masks:
    return view[...].astype(jnp.float32)
  mask = functools.reduce(operator.and_, masks)
  return plgpu_triton.load(view, mask=mask, other=0).astype(jnp.float32)


def _write(ref, cols, value):
  """ref[:, cols] = value in ref's dtype, up to the ref's last extent."""
  mask, view = _in_bounds(*cols, ref.shape[-1], 1), ref.at[:, pl.ds(*cols)]
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
  in_last = restarts == jnp.sum(reset)
  return y, in_last


def _gradients_kernel(k_ref, v_ref, beta_ref, w_ref, reset_ref, ip_ref, cm_ref, cb_ref,
                      dq_ref, dk_ref, dv_ref, dbeta_ref, s_ref, extra_ref,
                      dq_out, dk_out, dv_out, dbeta_out, dla_out, tail_out, *,
                      k_width, groups, interpret):
  precision = boundary.dot_precision(interpret)
  vp = v_ref.shape[-1]
  v_tiles = _tiles(vp, _MAX_TILE_V)
  # Over the first k_width columns only (k is zero past them), within the inputs' width
  # (the K reads need no mask: masked group reads would need a second indexer).
  k_tiles = _tiles(k_width, min(_MAX_TILE_K, k_ref.shape[-1]))
  w = w_ref[...][:, None]

  def group_sum(ref, cols):
    return functools.reduce(operator.add,
                            [_read(ref, cols, lead=(g,)) for g in range(groups)])

  for kt in k_tiles:
    _write(dq_out, kt, group_sum(dq_ref, kt))
  # dL/dlog a_t's per-step term (see op.py): -Ip s_t - v_t.dv_t - beta_t.dbeta_t + extra.
  # Two loop nests, so that one [chunk, tile] pair of sums is live at a time. Reads are
  # zero past the arrays' V and K extents, so padded columns add nothing.
  s_sum = functools.reduce(operator.add, [s_ref[g, :] for g in range(groups)])
  m_term = extra_ref[...] - ip_ref[0] * s_sum
  for vt in v_tiles:
    dv, dbeta = _read(dv_ref, vt), _read(dbeta_ref, vt)
    for kt in k_tiles:
      k = _read(k_ref, kt)
      dv += w * _dot(k, _read(cm_ref, kt, vt), ((1,), (1,)), precision)
      dbeta += w * _dot(k * k, _read(cb_ref, kt, vt), ((1,), (1,)), precision)
    m_term -= (jnp.sum(_read(v_ref, vt) * dv, axis=1)
               + jnp.sum(_read(beta_ref, vt) * dbeta, axis=1))
    _write(dv_out, vt, dv)
    _write(dbeta_out, vt, dbeta)
  for kt in k_tiles:
    from_m = from_b = 0.0
    for vt in v_tiles:
      from_m += _dot(_read(v_ref, vt), _read(cm_ref, kt, vt), ((1,), (0,)), precision)
      from_b += _dot(_read(beta_ref, vt), _read(cb_ref, kt, vt), ((1,), (0,)), precision)
    k = _read(k_ref, kt)
    _write(dk_out, kt, group_sum(dk_ref, kt) + w * (from_m + 2.0 * k * from_b))
  reset = reset_ref[...]
  y, in_last = _segmented_reverse_sum(m_term, reset)
  keep = reset == 0.0
  dla_out[...] = jnp.where(keep, y, 0.0)
  tail_out[...] = jnp.where(keep & in_last, 1.0, 0.0)


def assemble_gradients(k, v, beta, to_end, reset, ip_row, carry_m, carry_b, dq, dk, dv,
                       dbeta, s, extra, *, b: int, h: int, k_width: int, dtypes,
                       interpret: bool):
  """Gradients of q, k, v, beta in [B, Tp, H, D] and dlog_alpha's chunk-local sums.

  Args:
    k: [BH, Tp, Kw]; v, beta: [BH, Tp, Vp]; to_end: [BH, Tp] decay to the chunk end;
    reset: [BH, Tp] float32, 1.0 where a segment restarts; ip_row: [BH, Kw] prior
    precision; carry_m, carry_b: [BH, NC, Vp, Kw] adjoint carries at chunk ends.
    dq, dk: [G, BH, Tp, Kw]; dv, dbeta: [BH, Tp, Vp]; s: [G, BH, Tp]: the backward
    walk's chunk-local parts (G V-tile groups, summed here).
    extra: [BH, Tp] added to every step's dlog_alpha term (final state, variance).
    k_width: the K columns written out (a multiple of 16, <= Kw).
    dtypes: the dtypes of (dq, dk, dv, dbeta).

  Returns:
    dq, dk [B, Tp, H, k_width]; dv, dbeta [B, Tp, H, Vp]; dla_local [BH, Tp] (zero where
    a segment restarts) and in_tail [BH, Tp] (1.0 where the step's segment runs on to
    its chunk's end, else 0.0): see `finish_dlog_alpha`.
  """
  groups, bh, tp, kw = dq.shape
  vp = v.shape[-1]
  nc, chunk = carry_m.shape[1], tp // carry_m.shape[1]
  row_k = pl.BlockSpec((None, chunk, kw), lambda n, c: (n, c, 0))
  row_v = pl.BlockSpec((None, chunk, vp), lambda n, c: (n, c, 0))
  row = pl.BlockSpec((None, chunk), lambda n, c: (n, c))
  carry = pl.BlockSpec((None, None, vp, kw), lambda n, c: (n, c, 0, 0))
  group_k = pl.BlockSpec((groups, None, chunk, kw), lambda n, c: (0, n, c, 0))
  group_row = pl.BlockSpec((groups, None, chunk), lambda n, c: (0, n, c))

  def caller(width):
    return pl.BlockSpec((None, chunk, None, width), lambda n, c: (n // h, c, n % h, 0))

  kernel = functools.partial(_gradients_kernel, k_width=k_width, groups=groups,
                             interpret=interpret)
  params = None if interpret else plgpu_triton.CompilerParams(num_warps=8, num_stages=1)
  f32 = jnp.float32
  return pl.pallas_call(
      kernel, grid=(bh, nc),
      in_specs=[row_k, row_v, row_v, row, row,
                pl.BlockSpec((None, kw), lambda n, c: (n, 0)), carry, carry,
                group_k, group_k, row_v, row_v, group_row, row],
      out_specs=[caller(k_width), caller(k_width), caller(vp), caller(vp), row, row],
      out_shape=[jax.ShapeDtypeStruct((b, tp, h, k_width), dtypes[0]),
                 jax.ShapeDtypeStruct((b, tp, h, k_width), dtypes[1]),
                 jax.ShapeDtypeStruct((b, tp, h, vp), dtypes[2]),
                 jax.ShapeDtypeStruct((b, tp, h, vp), dtypes[3]),
                 jax.ShapeDtypeStruct((bh, tp), f32), jax.ShapeDtypeStruct((bh, tp), f32)],
      compiler_params=params, interpret=interpret, name="palimpsa_gradients",
  )(k, v, beta, to_end, reset, ip_row, carry_m, carry_b, dq, dk, dv, dbeta, s, extra)


def finish_dlog_alpha(dla_local, in_tail, reset, chunk: int) -> jax.Array:
  """dlog_alpha [BH, Tp]: the chunk-local sums plus the later chunks' part.

  A step whose segment runs on to its chunk's end gains the sums of every later chunk's
  leading segment that is still the same segment (no restart in between).
  """
  bh, tp = dla_local.shape
  nc = tp // chunk
  restarts = reset.reshape(bh, nc, chunk).astype(jnp.int32)
  per_chunk = jnp.sum(restarts, -1)
  upto = jnp.cumsum(per_chunk, -1)  # restarts in chunks <= c
  # Restarts after chunk c up to chunk c2's first step: upto[c2-1] - upto[c] + first[c2].
  before = upto - per_chunk + restarts[..., 0]
  between = before[:, None, :] - upto[:, :, None]  # [BH, c, c2]
  later = jnp.arange(nc)[None, :] > jnp.arange(nc)[:, None]
  linked = later[None] & (between == 0)
  heads = dla_local[:, ::chunk]  # each chunk's leading-segment sum
  from_later = jnp.sum(jnp.where(linked, heads[:, None, :], 0.0), -1)  # [BH, NC]
  return dla_local + in_tail * jnp.repeat(from_later, chunk, axis=-1)
