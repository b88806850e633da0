"""The backward's last stage: carry contributions, gradients in the caller's layout.

One Pallas kernel per (batch*head, chunk) adds the adjoint carries' contributions to
dv, dbeta and dk as tensor-core matmuls (the carry is constant inside a chunk), sums
the backward walk's V-tile groups, forms the dlog_alpha terms of every step with their
segment-wise reverse sum inside the chunk, and writes dq, dk, dv, dbeta as [B, Tp, H, D]
in the inputs' dtype. XLA then only adds the later chunks' part of dlog_alpha
(`finish_dlog_alpha`), on [B*H, Tp] rows.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.common import k_parts, largest_power_of_two_dividing
from pallas_kernels.palimpsa_gpu import boundary

_MAX_PART = 32  # Widest K- or V-part of the kernel's [chunk, part] tiles.


def _dot(x, y, contract, precision):
  """x [M, A] . y with `contract` = ((x axis,), (y axis,)); float32 out."""
  return jax.lax.dot_general(x, y, (contract, ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


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
  f32 = jnp.float32
  precision = boundary.dot_precision(interpret)
  kparts = k_parts(k_width, min(largest_power_of_two_dividing(k_width), _MAX_PART))
  vp = v_ref.shape[-1]
  vparts = k_parts(vp, min(largest_power_of_two_dividing(vp), _MAX_PART))
  w = w_ref[...][:, None]

  def rows(ref, p):
    return ref[:, p].astype(f32)

  def group_sum(ref, idx):
    return functools.reduce(lambda a, g: a + ref[(g,) + idx], range(1, groups),
                            ref[(0,) + idx])

  for p in kparts:
    dq_out[:, p] = group_sum(dq_ref, (slice(None), p)).astype(dq_out.dtype)
  # dL/dlog a_t's per-step term (see op.py): -Ip s_t - v_t.dv_t - beta_t.dbeta_t + extra.
  # Two loop nests, so that one [chunk, part] pair of sums is live at a time; operands
  # are loaded where they are used.
  m_term = extra_ref[...] - ip_ref[0] * group_sum(s_ref, (slice(None),))
  for pv in vparts:
    dv, dbeta = dv_ref[:, pv], dbeta_ref[:, pv]
    for pk in kparts:
      k = rows(k_ref, pk)
      dv += w * _dot(k, cm_ref[pv, pk], ((1,), (1,)), precision)
      dbeta += w * _dot(k * k, cb_ref[pv, pk], ((1,), (1,)), precision)
    m_term -= (jnp.sum(rows(v_ref, pv) * dv, axis=1)
               + jnp.sum(rows(beta_ref, pv) * dbeta, axis=1))
    dv_out[:, pv] = dv.astype(dv_out.dtype)
    dbeta_out[:, pv] = dbeta.astype(dbeta_out.dtype)
  for pk in kparts:
    from_m = from_b = 0.0
    for pv in vparts:
      from_m += _dot(rows(v_ref, pv), cm_ref[pv, pk], ((1,), (0,)), precision)
      from_b += _dot(rows(beta_ref, pv), cb_ref[pv, pk], ((1,), (0,)), precision)
    dk = group_sum(dk_ref, (slice(None), pk)) + w * (from_m + 2.0 * rows(k_ref, pk) * from_b)
    dk_out[:, pk] = dk.astype(dk_out.dtype)
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
