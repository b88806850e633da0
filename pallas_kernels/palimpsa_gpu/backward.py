"""The backward of palimpsa_gpu, from the op's arguments: the gates and boundary states
again, the reverse chunk walks (Triton or Mosaic GPU), the adjoint carries across chunks,
and the XLA parts that add the carries' contributions and turn the walks' sums into the
input gradients (dlog_alpha by a scaling identity)."""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.palimpsa_gpu import boundary_triton, forward, layout, stages
from pallas_kernels.palimpsa_gpu.config import GpuKernelConfig


def fit_width(x: jax.Array, width: int) -> jax.Array:
  """x [..., W] cut or zero-padded to [..., width] (no copy where W == width)."""
  have = x.shape[-1]
  if have >= width:
    return x[..., :width] if have > width else x
  return jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, width - have),))


def walk_starts(cfg: GpuKernelConfig, states: jax.Array) -> jax.Array:
  """Boundary states [BH, NC, Vp, Kb] (zero past K) -> the backward walk's [BH, NC, Vp, Ks],
  Ks the width its tiles take them at (`starts_k_width`: usually Kb, no copy)."""
  kb = states.shape[-1]
  return fit_width(states, cfg.walk_bwd.starts_k_width(cfg.k + cfg.k_pad, kb))


def walk_rows(cfg: GpuKernelConfig, q, k, v, beta, d_out, d_var):
  """The rows the backward walk reads, in the caller's layout padded (no copy without
  padding): q, k [B, Tp, H, k_bwd]; v, beta, dO [B, Tp, H, Vp]; the variance's cotangent
  [B, Tp, H, Vp] f32 (None without it)."""
  q_rows, k_rows = (layout.pad_rows(x, cfg.t_pad, cfg.k_bwd - cfg.k) for x in (q, k))
  v_rows, beta_rows, do_rows = (layout.pad_rows(x, cfg.t_pad, cfg.v_pad)
                                for x in (v, beta, d_out))
  dvar_rows = (layout.pad_rows(d_var.astype(jnp.float32), cfg.t_pad, cfg.v_pad)
               if cfg.return_variance else None)
  return q_rows, k_rows, v_rows, beta_rows, do_rows, dvar_rows


def segmented_reverse_cumsum(x: jax.Array, reset: jax.Array) -> jax.Array:
  """y_t = sum of x_u over u >= t up to (excluding) the next restart after t.

  x, reset: [BH, Tp]; reset_u True starts a new segment at u.
  """
  # Reverse time; a restart at u ends the reversed segment after position u.
  xr = jnp.flip(x, -1)
  stop = jnp.flip(reset, -1)

  def combine(left, right):
    lv, ls = left
    rv, rs = right
    return jnp.where(rs, rv, lv + rv), ls | rs

  # Segmented inclusive scan where a flag on an element starts a new segment at it:
  # the reversed sequence starts a new segment right after each restart.
  starts = jnp.concatenate([jnp.zeros_like(stop[:, :1]), stop[:, :-1]], axis=-1)
  vals, _ = jax.lax.associative_scan(combine, (xr, starts), axis=-1)
  return jnp.flip(vals, -1)


def backward(cfg: GpuKernelConfig, saved, cotangents):
  """The gradients of palimpsa_gpu's float inputs from what its forward keeps (its
  arguments q, k, v, beta, log_alpha, prior_precision, initial_mu, initial_precision,
  starts and the variance it returned, or None) and the cotangents of (out, var,
  mu_final, precision_final)."""
  (q, k, v, beta, log_alpha, prior_precision, initial_mu, initial_precision, starts,
   var) = saved
  d_out, d_var, d_mu_final, d_prec_final = cotangents
  bp = forward.boundary_pass(cfg, k, v, beta, log_alpha, prior_precision, initial_mu,
                             initial_precision, starts)
  gates, ip = bp.gates, bp.ip
  # The backward works with K padded to k_bwd (zeros; padded entries stay at the prior):
  # q and k come at that width, the boundary states are read as zero past theirs.
  kw = cfg.k_bwd
  m_starts, ibar_starts = walk_starts(cfg, bp.m_starts), walk_starts(cfg, bp.ibar_starts)
  m_final, ibar_final = fit_width(bp.m_final, kw), fit_width(bp.ibar_final, kw)
  rows = walk_rows(cfg, q, k, v, beta, d_out, d_var)
  f32 = jnp.float32
  bh, tp, kp, vp = cfg.b * cfg.h, cfg.t + cfg.t_pad, kw, cfg.v + cfg.v_pad
  nc = tp // cfg.chunk
  walk_outs = []
  ip_cols = layout.ip_row(ip, kw)
  size = bh // stages.walk_pieces(cfg)
  for first in range(0, bh, size):
    outs = stages.run("walk_bwd", cfg, *rows[:4], gates.step, ip_cols, *rows[4:], m_starts,
                      ibar_starts, bh_range=(first, size))
    dq, dk, dv, dbeta, s, adj_m, adj_ibar = outs
    walk_outs.append((jnp.sum(dq, axis=0), jnp.sum(dk, axis=0), jnp.sum(dv, axis=0),
                      jnp.sum(dbeta, axis=0), jnp.sum(s, axis=(0, 1)), adj_m, adj_ibar))
  dq, dk, dv, dbeta, s, adj_m, adj_ibar = (
      xs[0] if len(xs) == 1 else jnp.concatenate(xs) for xs in zip(*walk_outs))

  # Adjoint of the final linear state.
  ipb = ip[:, None, None]
  i_final = ibar_final + ipb
  r_final = 1.0 / i_final
  mu_final = m_final * r_final
  dmu_f = layout.state_to_head_major(d_mu_final.astype(f32), cfg.v_pad, kw - cfg.k)
  dprec_f = layout.state_to_head_major(d_prec_final.astype(f32), cfg.v_pad,
                                       kw - cfg.k)
  dm_end = dmu_f * r_final
  dibar_end = dprec_f - dmu_f * mu_final * r_final
  carry_m, carry_ibar, dm0, dibar0 = stages.run("carries_bwd", cfg, dm_end, dibar_end,
                                                 gates.chunk, adj_m, adj_ibar)

  # Carries are constant inside a chunk: their contributions are matmuls, per batch*head
  # and chunk on head-major rows.
  kh, vh, betah = (layout.to_head_major(x, 0, 0) for x in rows[1:4])
  c = cfg.chunk
  kf = kh.astype(f32).reshape(bh, nc, c, kp)
  vf = vh.astype(f32).reshape(bh, nc, c, vp)
  betaf = betah.astype(f32).reshape(bh, nc, c, vp)
  w = gates.to_end.reshape(bh, nc, c, 1)
  ein = functools.partial(jnp.einsum, precision=boundary_triton.dot_precision(cfg.interpret))
  dv = dv + (w * ein("nctk,ncvk->nctv", kf, carry_m)).reshape(bh, tp, vp)
  dbeta = dbeta + (w * ein("nctk,ncvk->nctv", kf * kf, carry_ibar)).reshape(bh, tp, vp)
  dk_carry = ein("nctv,ncvk->nctk", vf, carry_m) + 2.0 * kf * ein(
      "nctv,ncvk->nctk", betaf, carry_ibar)
  dk = dk + (w * dk_carry).reshape(bh, tp, kp)

  # dlog_alpha via the scaling identity (segment-wise reverse sums).
  # s [BH, Tp]: sum_{v,k} dL/dI_t (local).
  m_term = -ip[:, None] * s - jnp.sum(vh.astype(f32) * dv, -1) - jnp.sum(
      betah.astype(f32) * dbeta, -1)
  if cfg.return_variance:
    var_term = jnp.sum(d_var.astype(f32) * var, -1)  # [B, T, H]
    var_term = jnp.transpose(var_term, (0, 2, 1)).reshape(bh, cfg.t)
    m_term = m_term - jnp.pad(var_term, ((0, 0), (0, cfg.t_pad)))
  final_term = jnp.sum(dm_end * m_final + dibar_end * ibar_final, axis=(1, 2))
  m_term = m_term.at[:, -1].add(final_term)
  dla = segmented_reverse_cumsum(m_term, gates.reset)
  dla = jnp.where(gates.reset, 0.0, dla)

  # Prior precision: I_t = Ibar_t + Ip at every step, Ibar_0 = I_0 - Ip.
  d_ip = jnp.sum(s, -1) + jnp.sum(dibar_end, (1, 2)) - jnp.sum(dibar0, (1, 2))
  d_ip = d_ip.reshape(cfg.b, cfg.h).sum(0)

  # Initial state: M_0 = mu_0 * I_0, Ibar_0 = I_0 - Ip.
  b, h, v_dim, k_dim = cfg.b, cfg.h, cfg.v, cfg.k
  dm0 = layout.state_from_head_major(dm0, b, h, v_dim, k_dim)
  dibar0 = layout.state_from_head_major(dibar0, b, h, v_dim, k_dim)
  mu0 = initial_mu.astype(f32)
  i0 = initial_precision.astype(f32)
  d_mu0 = dm0 * i0
  d_i0 = dm0 * mu0 + dibar0

  def back(x, d, dtype):
    return layout.from_head_major(x, b, h, cfg.t, d).astype(dtype)

  dla = jnp.transpose(dla[:, :cfg.t].reshape(b, h, cfg.t), (0, 2, 1))
  return (back(dq, k_dim, q.dtype), back(dk, k_dim, k.dtype), back(dv, v_dim, v.dtype),
          back(dbeta, v_dim, beta.dtype), dla.astype(cfg.log_alpha_dtype),
          d_ip.astype(cfg.prior_dtype), d_mu0.astype(initial_mu.dtype),
          d_i0.astype(initial_precision.dtype))


