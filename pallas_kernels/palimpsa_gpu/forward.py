"""The forward of palimpsa_gpu: boundary states, the forward walk, and the XLA parts
between them (padding, layouts, the linear state), with the residuals of the backward."""

import jax
import jax.numpy as jnp

from pallas_kernels.palimpsa_gpu import layout, stages
from pallas_kernels.palimpsa_gpu.config import GpuKernelConfig


def prepare(cfg: GpuKernelConfig, q, k, v, beta, log_alpha, prior_precision, starts):
  """Head-major copies of q, k, v, beta for the backward walk (q, k at its width), the
  gates, and the prior precision per batch*head [BH] float32."""
  tp, vp = cfg.t_pad, cfg.v_pad
  qh = layout.to_head_major(q, tp, cfg.k_bwd - cfg.k)
  kh = layout.to_head_major(k, tp, cfg.k_bwd - cfg.k)
  vh = layout.to_head_major(v, tp, vp)
  betah = layout.to_head_major(beta, tp, vp)
  gates = layout.make_gates(log_alpha, starts, cfg.h, tp, cfg.chunk)
  ip = jnp.tile(prior_precision.astype(jnp.float32), cfg.b)  # [BH]
  return qh, kh, vh, betah, gates, ip


def pad_state(cfg: GpuKernelConfig, x: jax.Array, k_width: int) -> jax.Array:
  """[..., V, K] -> [..., Vp, k_width] with zeros in the padding."""
  pad = ((0, 0),) * (x.ndim - 2) + ((0, cfg.v_pad), (0, k_width - cfg.k))
  return jnp.pad(x, pad)


def initial_linear_state(cfg: GpuKernelConfig, initial_mu, initial_precision, ip, k_width):
  """(M0, Ibar0) [BH, Vp, k_width]; padded entries sit at the prior (M=0, Ibar=0)."""
  shape = (cfg.b * cfg.h, cfg.v, cfg.k)
  i0 = initial_precision.astype(jnp.float32).reshape(shape)
  m0 = initial_mu.astype(jnp.float32).reshape(shape) * i0
  return pad_state(cfg, m0, k_width), pad_state(cfg, i0 - ip[:, None, None], k_width)


def forward_rows(cfg: GpuKernelConfig, q, k, v, beta):
  """The rows the forward kernels read, in the caller's layout padded:
  (q, k, v, beta, k padded to k_boundary), each [B, Tp, H, Dp]."""
  q_rows, k_rows = (layout.pad_rows(x, cfg.t_pad, cfg.k_pad) for x in (q, k))
  v_rows, beta_rows = (layout.pad_rows(x, cfg.t_pad, cfg.v_pad) for x in (v, beta))
  return (q_rows, k_rows, v_rows, beta_rows,
          layout.pad_rows(k, cfg.t_pad, cfg.k_boundary - cfg.k))


def boundary_states(cfg: GpuKernelConfig, k_bound, v_rows, beta_rows, gates, m0, ibar0):
  """(m_starts, ibar_starts [BH, NC, Vp, Kb], m_final, ibar_final [BH, Vp, Kb]) f32 from
  forward_rows' k_bound, v_rows, beta_rows, the gates and the initial linear state."""
  return stages.run("boundary_fwd", cfg, k_bound, v_rows, beta_rows, gates.to_end, gates.chunk,
                    m0, ibar0)


def forward(cfg: GpuKernelConfig, q, k, v, beta, log_alpha, prior_precision, initial_mu,
            initial_precision, starts):
  """((out, var, mu_final, precision_final), residuals); arguments as palimpsa_gpu's.

  residuals: (qh, kh, vh, betah, gates, ip, m_starts, ibar_starts, m_final, ibar_final, var,
  initial_mu, initial_precision), the boundary states without the V/K padding.
  """
  qh, kh, vh, betah, gates, ip = prepare(
      cfg, q, k, v, beta, log_alpha, prior_precision, starts)
  m0, ibar0 = initial_linear_state(cfg, initial_mu, initial_precision, ip, cfg.k_boundary)
  q_rows, k_rows, v_rows, beta_rows, k_bound = forward_rows(cfg, q, k, v, beta)
  m_starts, ibar_starts, m_final, ibar_final = boundary_states(
      cfg, k_bound, v_rows, beta_rows, gates, m0, ibar0)
  outs = stages.run("walk_fwd", cfg, q_rows, k_rows, v_rows, beta_rows, gates.step, ip,
                    m_starts, ibar_starts)
  # The walk writes [B, Tp, H, Vp]: the caller's layout, padded.
  out = outs[0][:, :cfg.t, :, :cfg.v]
  var = outs[1][:, :cfg.t, :, :cfg.v] if cfg.return_variance else None
  i_final = ibar_final + ip[:, None, None]
  mu_final = layout.state_from_head_major(m_final / i_final, cfg.b, cfg.h, cfg.v,
                                          cfg.k)
  prec_final = layout.state_from_head_major(i_final, cfg.b, cfg.h, cfg.v, cfg.k)
  # The saved states drop the V/K padding (zero there: padded entries stay at the
  # prior), so the chunk-boundary ones take (T/chunk) * V * K * 2 floats per
  # batch-head; the backward pads them again.
  unpad = lambda x: x[..., :cfg.v, :cfg.k]
  residuals = (qh, kh, vh, betah, gates, ip, unpad(m_starts), unpad(ibar_starts),
               unpad(m_final), unpad(ibar_final), var, initial_mu, initial_precision)
  return (out, var, mu_final, prec_final), residuals
