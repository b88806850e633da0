"""Backward kernel: chunks in reverse grid order, the adjoint of (M, Ibar) carried across them.

Grid (N, V tiles, chunks) with the chunk axis sequential and reversed. For its chunk a program
  1. walks forward from the chunk-start state saved by the forward pass, keeping a checkpoint
     every S steps (S = Geometry.sub, sized to VMEM);
  2. for each S-step block, last first: recomputes its states into VMEM, then walks them in
     reverse, accumulating the adjoints lam_M, lam_I (carried in VMEM scratch) and emitting
     dq, dk, dv, dbeta and d log_alpha for every step.
Per step t, with R = 1/I_t, mu = M_t R, G = q do^T (transposed tiles):
  lam_M += G R;  lam_I += -R (mu G + q^2 dvar^T R);  dIp += lam_I's increment;
  dv = lam_M^T k;  dbeta = lam_I^T k^2;  dk = lam_M v + 2 k (lam_I beta);
  dq = mu do + 2 q (R dvar);  d log_alpha = alpha <lam_M, M_{t-1}> + alpha <lam_I, Ibar_{t-1}>;
  then lam *= alpha_t.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.palimpsa_tpu import walk
from pallas_kernels.palimpsa_tpu.layout import LANES, Geometry


def _backward_kernel(q_ref, k_ref, v_ref, beta_ref, gate_ref, ip_ref, m_start_ref,
                     ibar_start_ref, lam_m_end_ref, lam_i_end_ref, dout_ref, *rest,
                     has_var, sub):
  if has_var:
    dvar_ref, *rest = rest
  (dq_ref, dk_ref, dv_ref, dbeta_ref, dgate_ref, lam_m0_ref, lam_i0_ref, dip_ref,
   lam_m, lam_i, dip_acc, ck_m, ck_i, st_m, st_i, dq_acc, dk_acc, dgate_acc) = rest
  c = pl.program_id(2)
  n_sub = ck_m.shape[0]

  @pl.when(c == 0)
  def _():
    lam_m[...] = lam_m_end_ref[0]
    lam_i[...] = lam_i_end_ref[0]
    dip_acc[...] = jnp.zeros_like(dip_acc)

  ip = ip_ref[0]                                                 # [1, BV]
  q_t = q_ref[0].astype(jnp.float32)                             # [Kp, C]
  k_t = k_ref[0].astype(jnp.float32)
  gates = gate_ref[0]                                            # [1, C]

  def advance(t, m, ibar):
    mask = walk.lane_mask(k_t.shape, t)
    a = walk.column(gates, walk.lane_mask(gates.shape, t))
    return walk.advance(m, ibar, a, walk.column(k_t, mask),
                        walk.row(v_ref, t), walk.row(beta_ref, t))

  # 1. Checkpoints: ck[j] = state before step j*S of the chunk.
  ck_m[0] = m_start_ref[0, 0]
  ck_i[0] = ibar_start_ref[0, 0]

  def checkpoint(j, carry):
    start = (j - 1) * sub
    carry = jax.lax.fori_loop(0, sub, lambda s, st: advance(start + s, *st), carry)
    ck_m[j] = carry[0]
    ck_i[j] = carry[1]
    return carry

  jax.lax.fori_loop(1, n_sub, checkpoint, (ck_m[0], ck_i[0]))

  # 2. Per S-step block, last first: recompute st[s] = state after s steps, then reverse walk.
  def block(jj, _):
    j = n_sub - 1 - jj
    st_m[0] = ck_m[j]
    st_i[0] = ck_i[j]

    def recompute(s, carry):
      carry = advance(j * sub + s, *carry)
      st_m[s + 1] = carry[0]
      st_i[s + 1] = carry[1]
      return carry

    jax.lax.fori_loop(0, sub, recompute, (ck_m[j], ck_i[j]))

    def reverse_step(ss, _):
      s = sub - 1 - ss
      t = j * sub + s
      m, ibar = st_m[s + 1], st_i[s + 1]
      mask = walk.lane_mask(k_t.shape, t)
      gate_mask = walk.lane_mask(gates.shape, t)
      q_col = walk.column(q_t, mask)
      k_col = walk.column(k_t, mask)
      v_row = walk.row(v_ref, t)
      beta_row = walk.row(beta_ref, t)
      a = walk.column(gates, gate_mask)
      do_row = walk.row(dout_ref, t)
      r = 1.0 / (ibar + ip)
      mu = m * r
      g = q_col * do_row
      if has_var:
        dvar_row = walk.row(dvar_ref, t)
        d_i = -r * (mu * g + (q_col * q_col) * dvar_row * r)
        dq_var = 2.0 * q_col * jnp.sum(r * dvar_row, axis=1, keepdims=True)
      else:
        d_i = -r * (mu * g)
        dq_var = 0.0
      lm = lam_m[...] + g * r
      li = lam_i[...] + d_i
      dip_acc[...] += d_i
      dv_ref[0, pl.ds(t, 1), :] = jnp.sum(lm * k_col, axis=0, keepdims=True)
      dbeta_ref[0, pl.ds(t, 1), :] = jnp.sum(li * (k_col * k_col), axis=0, keepdims=True)
      dk_col = (jnp.sum(lm * v_row, axis=1, keepdims=True)
                + 2.0 * k_col * jnp.sum(li * beta_row, axis=1, keepdims=True))
      dq_col = jnp.sum(mu * do_row, axis=1, keepdims=True) + dq_var
      dk_acc[...] = walk.put_column(dk_acc[...], dk_col, mask)
      dq_acc[...] = walk.put_column(dq_acc[...], dq_col, mask)
      da = jnp.sum(jnp.sum(lm * st_m[s] + li * st_i[s], axis=0, keepdims=True), axis=1,
                   keepdims=True)
      dgate_acc[...] = walk.put_column(dgate_acc[...], a * da, gate_mask)
      lam_m[...] = a * lm
      lam_i[...] = a * li
      return 0

    jax.lax.fori_loop(0, sub, reverse_step, 0)
    return 0

  jax.lax.fori_loop(0, n_sub, block, 0)
  dq_ref[0, 0] = dq_acc[...]
  dk_ref[0, 0] = dk_acc[...]
  dgate_ref[0, 0] = dgate_acc[...]

  @pl.when(c == pl.num_programs(2) - 1)
  def _():
    lam_m0_ref[0] = lam_m[...]
    lam_i0_ref[0] = lam_i[...]
    dip_ref[0] = dip_acc[...]


def backward(q_t, k_t, v, beta, gate, ip, m_start, ibar_start, lam_m_end, lam_i_end, dout, dvar,
             g: Geometry, interpret):
  """Gradients in kernel layout.

  Inputs as in forward.py, plus lam_m_end, lam_i_end [N,Kp,Vp] (adjoints of the final M, Ibar)
  and dout, dvar [N,Tp,Vp] float32 (dvar None without variance). Returns
  dq_t, dk_t [N, Vtiles, Kp, Tp] (partial over value tiles), dv, dbeta [N,Tp,Vp],
  dlog_alpha [N, Vtiles, 1, Tp] (partial), lam_m0, lam_i0 [N,Kp,Vp] (adjoints of the initial
  M, Ibar) and dip [N,Kp,Vp] (elementwise terms of dL/dIp), all float32.
  """
  nc = g.num_chunks
  rev = lambda c: nc - 1 - c
  keys = pl.BlockSpec((1, g.kp, g.chunk), lambda n, j, c: (n, 0, rev(c)))
  values = pl.BlockSpec((1, g.chunk, LANES), lambda n, j, c: (n, rev(c), j))
  steps = pl.BlockSpec((1, 1, g.chunk), lambda n, j, c: (n, 0, rev(c)))
  state = pl.BlockSpec((1, g.kp, LANES), lambda n, j, c: (n, 0, j))
  chunk_state = pl.BlockSpec((1, 1, g.kp, LANES), lambda n, j, c: (n, rev(c), 0, j))
  prior = pl.BlockSpec((1, 1, LANES), lambda n, j, c: (n, 0, j))
  key_grads = pl.BlockSpec((1, 1, g.kp, g.chunk), lambda n, j, c: (n, j, 0, rev(c)))
  step_grads = pl.BlockSpec((1, 1, 1, g.chunk), lambda n, j, c: (n, j, 0, rev(c)))
  has_var = dvar is not None
  f32 = jnp.float32
  tile = (g.kp, LANES)
  n_sub = g.chunk // g.sub
  kernel = lambda *refs: _backward_kernel(*refs, has_var=has_var, sub=g.sub)
  state_shape = jax.ShapeDtypeStruct((g.n, g.kp, g.vp), f32)
  return pl.pallas_call(
      kernel,
      name="palimpsa_tpu_backward",
      grid=(g.n, g.num_vtiles, nc),
      in_specs=[keys, keys, values, values, steps, prior, chunk_state, chunk_state, state, state,
                values] + ([values] if has_var else []),
      out_specs=[key_grads, key_grads, values, values, step_grads, state, state, state],
      out_shape=[jax.ShapeDtypeStruct((g.n, g.num_vtiles, g.kp, g.tp), f32)] * 2
      + [jax.ShapeDtypeStruct((g.n, g.tp, g.vp), f32)] * 2
      + [jax.ShapeDtypeStruct((g.n, g.num_vtiles, 1, g.tp), f32)]
      + [state_shape] * 3,
      scratch_shapes=[pltpu.VMEM(tile, f32)] * 3
      + [pltpu.VMEM((n_sub,) + tile, f32)] * 2
      + [pltpu.VMEM((g.sub + 1,) + tile, f32)] * 2
      + [pltpu.VMEM((g.kp, g.chunk), f32)] * 2
      + [pltpu.VMEM((1, g.chunk), f32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret,
  )(q_t, k_t, v, beta, gate, ip, m_start, ibar_start, lam_m_end, lam_i_end, dout,
    *([dvar] if has_var else []))
