"""The forward of palimpsa_gpu: boundary states, the forward walk, and the XLA parts
between them (padding, the gates, the linear state). The backward keeps none of them: it
recomputes the gates and the boundary states from the op's arguments (`boundary_pass`)."""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.palimpsa_gpu import layout, stages
from pallas_kernels.palimpsa_gpu.config import GpuKernelConfig


class BoundaryPass(NamedTuple):
  """What the boundary kernel gives and takes, in the layouts the walks read.

  gates: layout.Gates; ip: [BH] f32 prior precision per batch*head; v_rows, beta_rows:
  [B, Tp, H, Vp] (the caller's layout, padded); m_starts, ibar_starts: [BH, NC, Vp, Kb]
  f32 linear state at each chunk start; m_final, ibar_final: [BH, Vp, Kb] f32
  (Kb = cfg.k_boundary; entries in the V/K padding stay 0, at the prior).
  """

  gates: layout.Gates
  ip: jax.Array
  v_rows: jax.Array
  beta_rows: jax.Array
  m_starts: jax.Array
  ibar_starts: jax.Array
  m_final: jax.Array
  ibar_final: jax.Array


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


def boundary_pass(cfg: GpuKernelConfig, k, v, beta, log_alpha, prior_precision, initial_mu,
                  initial_precision, starts) -> BoundaryPass:
  """The gates and the boundary kernel's states from the op's arguments (as palimpsa_gpu's)."""
  gates = layout.make_gates(log_alpha, starts, cfg.h, cfg.t_pad, cfg.chunk)
  ip = jnp.tile(prior_precision.astype(jnp.float32), cfg.b)  # [BH]
  v_rows, beta_rows = (layout.pad_rows(x, cfg.t_pad, cfg.v_pad) for x in (v, beta))
  k_bound = layout.pad_rows(k, cfg.t_pad, cfg.k_boundary - cfg.k)
  m0, ibar0 = initial_linear_state(cfg, initial_mu, initial_precision, ip, cfg.k_boundary)
  states = stages.run("boundary_fwd", cfg, k_bound, v_rows, beta_rows, gates.to_end,
                      gates.chunk, m0, ibar0)
  return BoundaryPass(gates, ip, v_rows, beta_rows, *states)


def forward(cfg: GpuKernelConfig, q, k, v, beta, log_alpha, prior_precision, initial_mu,
            initial_precision, starts):
  """(out, var, mu_final, precision_final); arguments as palimpsa_gpu's."""
  bp = boundary_pass(cfg, k, v, beta, log_alpha, prior_precision, initial_mu,
                     initial_precision, starts)
  q_rows, k_rows = (layout.pad_rows(x, cfg.t_pad, cfg.k_pad) for x in (q, k))
  outs = stages.run("walk_fwd", cfg, q_rows, k_rows, bp.v_rows, bp.beta_rows, bp.gates.step,
                    bp.ip, bp.m_starts, bp.ibar_starts)
  # The walk writes [B, Tp, H, Vp]: the caller's layout, padded.
  out = outs[0][:, :cfg.t, :, :cfg.v]
  var = outs[1][:, :cfg.t, :, :cfg.v] if cfg.return_variance else None
  i_final = bp.ibar_final + bp.ip[:, None, None]
  mu_final = layout.state_from_head_major(bp.m_final / i_final, cfg.b, cfg.h, cfg.v, cfg.k)
  prec_final = layout.state_from_head_major(i_final, cfg.b, cfg.h, cfg.v, cfg.k)
  return out, var, mu_final, prec_final
