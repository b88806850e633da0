"""Pallas (Triton) kernels that walk the steps of one chunk for one V-tile.

Grid (B*H, chunk, V-tile). Each program starts from its chunk-boundary state [BV, Kp]
(float32, in registers) and steps through the chunk one token at a time.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.common import fast_reciprocal


def _params(num_warps: int, interpret: bool):
  if interpret:
    return None
  return plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=1)


def _forward_kernel(q_ref, k_ref, v_ref, beta_ref, a_ref, ip_ref, m0_ref, b0_ref,
                    *out_refs, chunk, sub, with_out, with_var, with_states,
                    interpret):
  """Walks one chunk: writes readouts and/or the states at every sub-chunk start."""
  refs = list(out_refs)
  out_ref = refs.pop(0) if with_out else None
  var_ref = refs.pop(0) if with_var else None
  sm_ref, sb_ref = (refs.pop(0), refs.pop(0)) if with_states else (None, None)
  ip = ip_ref[...].astype(jnp.float32)[None, :]

  def step(t, carry):
    m, b = carry
    if with_states:

      @pl.when(jax.lax.rem(t, sub) == 0)
      def _():
        sm_ref[jax.lax.div(t, sub)] = m
        sb_ref[jax.lax.div(t, sub)] = b

    k = k_ref[t, :].astype(jnp.float32)[None, :]
    v = v_ref[t, :].astype(jnp.float32)[:, None]
    beta = beta_ref[t, :].astype(jnp.float32)[:, None]
    a = a_ref[t]
    m = a * m + v * k
    b = a * b + beta * (k * k)
    if with_out or with_var:
      q = q_ref[t, :].astype(jnp.float32)[None, :]
      r = fast_reciprocal(b + ip, interpret=interpret)
      if with_out:
        out_ref[t, :] = jnp.sum(m * r * q, axis=1).astype(out_ref.dtype)
      if with_var:
        var_ref[t, :] = jnp.sum(r * (q * q), axis=1)
    return m, b

  jax.lax.fori_loop(0, chunk, step, (m0_ref[...], b0_ref[...]))


def walk_forward(q, k, v, beta, a, ip_row, m_starts, b_starts, *, chunk: int,
                 block_v: int, sub: int, with_out: bool, with_var: bool,
                 with_states: bool, out_dtype, num_warps: int, interpret: bool):
  """Forward walk over all chunks.

  Args:
    q, k: [BH, Tp, Kp]; v, beta: [BH, Tp, Vp]; a: [BH, Tp] step gates;
    ip_row: [BH, Kp] prior precision; m_starts, b_starts: [BH, NC, Vp, Kp].

  Returns:
    list of (out [BH, Tp, Vp] out_dtype) if with_out, (var [BH, Tp, Vp] f32) if
    with_var, (sub_m, sub_b [BH, Tp/sub, Vp, Kp] f32: states before every sub-chunk)
    if with_states.
  """
  bh, tp, kp = q.shape
  vp = v.shape[-1]
  nc, nv = tp // chunk, vp // block_v
  row_k = pl.BlockSpec((None, chunk, kp), lambda n, c, j: (n, c, 0))
  row_v = pl.BlockSpec((None, chunk, block_v), lambda n, c, j: (n, c, j))
  state = pl.BlockSpec((None, None, block_v, kp), lambda n, c, j: (n, c, j, 0))
  in_specs = [row_k, row_k, row_v, row_v,
              pl.BlockSpec((None, chunk), lambda n, c, j: (n, c)),
              pl.BlockSpec((None, kp), lambda n, c, j: (n, 0)), state, state]
  out_specs, out_shape = [], []
  if with_out:
    out_specs.append(row_v)
    out_shape.append(jax.ShapeDtypeStruct((bh, tp, vp), out_dtype))
  if with_var:
    out_specs.append(row_v)
    out_shape.append(jax.ShapeDtypeStruct((bh, tp, vp), jnp.float32))
  if with_states:
    sub_spec = pl.BlockSpec((None, chunk // sub, block_v, kp),
                            lambda n, c, j: (n, c, j, 0))
    out_specs += [sub_spec, sub_spec]
    out_shape += [jax.ShapeDtypeStruct((bh, tp // sub, vp, kp), jnp.float32)] * 2
  kernel = functools.partial(
      _forward_kernel, chunk=chunk, sub=sub, with_out=with_out, with_var=with_var,
      with_states=with_states, interpret=interpret)
  return pl.pallas_call(
      kernel, grid=(bh, nc, nv), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, compiler_params=_params(num_warps, interpret),
      interpret=interpret, name="palimpsa_walk_forward",
  )(q, k, v, beta, a, ip_row, m_starts, b_starts)


def _backward_kernel(q_ref, k_ref, v_ref, beta_ref, a_ref, ip_ref, do_ref, dvar_ref,
                     sm_ref, sb_ref, dq_ref, dk_ref, dv_ref, dbeta_ref, s_ref,
                     am_ref, ab_ref, *, chunk, sub, with_var, interpret):
  """Reverse walk of one chunk with zero adjoint entering from later chunks."""
  ip = ip_ref[...].astype(jnp.float32)[None, :]
  n_sub = chunk // sub

  def sub_chunk(i, carry):
    gm, gb = carry
    j = n_sub - 1 - i
    m, b = sm_ref[j], sb_ref[j]
    rows, states = [], []
    for s in range(sub):  # Recompute the sub-chunk's states, kept in registers.
      t = j * sub + s
      k = k_ref[t, :].astype(jnp.float32)
      v = v_ref[t, :].astype(jnp.float32)
      beta = beta_ref[t, :].astype(jnp.float32)
      a = a_ref[t]
      m = a * m + v[:, None] * k[None, :]
      b = a * b + beta[:, None] * (k * k)[None, :]
      rows.append((t, k, v, beta, a))
      states.append((m, b))
    for s in reversed(range(sub)):
      t, k, v, beta, a = rows[s]
      m, b = states[s]
      q = q_ref[t, :].astype(jnp.float32)
      do = do_ref[t, :].astype(jnp.float32)
      r = fast_reciprocal(b + ip, interpret=interpret)
      mu = m * r
      dmu = do[:, None] * q[None, :]
      dr = dmu * m
      dq = jnp.sum(do[:, None] * mu, axis=0)
      if with_var:
        dvar = dvar_ref[t, :].astype(jnp.float32)
        dr = dr + dvar[:, None] * (q * q)[None, :]
        dq = dq + 2.0 * q * jnp.sum(dvar[:, None] * r, axis=0)
      di = -(r * r) * dr
      gm = gm + dmu * r
      gb = gb + di
      dq_ref[t, :] = dq
      dk_ref[t, :] = jnp.sum(gm * v[:, None], axis=0) + 2.0 * k * jnp.sum(
          gb * beta[:, None], axis=0)
      dv_ref[t, :] = jnp.sum(gm * k[None, :], axis=1)
      dbeta_ref[t, :] = jnp.sum(gb * (k * k)[None, :], axis=1)
      s_ref[t, :] = jnp.sum(di, axis=1)
      gm = a * gm
      gb = a * gb
    return gm, gb

  zeros = jnp.zeros(am_ref.shape, jnp.float32)
  gm, gb = jax.lax.fori_loop(0, n_sub, sub_chunk, (zeros, zeros))
  am_ref[...] = gm
  ab_ref[...] = gb


def walk_backward(q, k, v, beta, a, ip_row, do, dvar, sub_m, sub_b, *, chunk: int,
                  block_v: int, sub: int, num_warps: int, interpret: bool):
  """Reverse walk over all chunks, each with zero adjoint from later chunks.

  Args:
    q, k: [BH, Tp, Kp]; v, beta, do: [BH, Tp, Vp]; dvar: [BH, Tp, Vp] or None;
    a: [BH, Tp]; ip_row: [BH, Kp]; sub_m, sub_b: [BH, Tp/sub, Vp, Kp].

  Returns:
    dq_part, dk_part [NV, BH, Tp, Kp] (to be summed over V-tiles); dv, dbeta, s
    [BH, Tp, Vp] (chunk-local adjoint parts; s = sum_k dL/dI_t); adj_m, adj_b
    [BH, NC, Vp, Kp]: each chunk's adjoint of the state before its first step.
  """
  bh, tp, kp = q.shape
  vp = v.shape[-1]
  nc, nv = tp // chunk, vp // block_v
  with_var = dvar is not None
  row_k = pl.BlockSpec((None, chunk, kp), lambda n, c, j: (n, c, 0))
  row_v = pl.BlockSpec((None, chunk, block_v), lambda n, c, j: (n, c, j))
  sub_spec = pl.BlockSpec((None, chunk // sub, block_v, kp),
                          lambda n, c, j: (n, c, j, 0))
  part_k = pl.BlockSpec((None, None, chunk, kp), lambda n, c, j: (j, n, c, 0))
  state = pl.BlockSpec((None, None, block_v, kp), lambda n, c, j: (n, c, j, 0))
  f32 = jnp.float32
  kernel = functools.partial(_backward_kernel, chunk=chunk, sub=sub,
                             with_var=with_var, interpret=interpret)
  if not with_var:
    dvar = jnp.zeros((bh, chunk, block_v), f32)  # Never read.
    dvar_spec = pl.BlockSpec((None, chunk, block_v), lambda n, c, j: (0, 0, 0))
  else:
    dvar_spec = row_v
  return pl.pallas_call(
      kernel, grid=(bh, nc, nv),
      in_specs=[row_k, row_k, row_v, row_v,
                pl.BlockSpec((None, chunk), lambda n, c, j: (n, c)),
                pl.BlockSpec((None, kp), lambda n, c, j: (n, 0)),
                row_v, dvar_spec, sub_spec, sub_spec],
      out_specs=[part_k, part_k, row_v, row_v, row_v, state, state],
      out_shape=[jax.ShapeDtypeStruct((nv, bh, tp, kp), f32)] * 2
      + [jax.ShapeDtypeStruct((bh, tp, vp), f32)] * 3
      + [jax.ShapeDtypeStruct((bh, nc, vp, kp), f32)] * 2,
      compiler_params=_params(num_warps, interpret), interpret=interpret,
      name="palimpsa_walk_backward",
  )(q, k, v, beta, a, ip_row, do, dvar, sub_m, sub_b)
