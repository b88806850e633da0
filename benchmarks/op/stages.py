"""The palimpsa_gpu kernel's stages run alone, on the inputs the op passes them.

The tile tuning (benchmarks/op/tuning.py --op palimpsa) times each stage's tile variants
this way, and the Nsight Compute profile (benchmarks/op/profile.py --ncu) runs one stage so.
"""

import functools

import jax
import jax.numpy as jnp

from benchmarks.op.timing import make_inputs
from pallas_kernels.palimpsa_gpu import backward, forward, layout, stages

# The stages run alone, and the op's stage (stages.KERNELS) behind each.
STAGES = ("boundary", "walk_fwd", "walk_bwd")
OP_STAGES = {"boundary": "boundary_fwd", "walk_fwd": "walk_fwd", "walk_bwd": "walk_bwd"}


def kernel_inputs(seed, shape, dtype=jnp.bfloat16):
  """(timing.make_inputs' inputs plus an initial state (mu 0, precision 1), an output cotangent) of
  shape (B, T, H, K, V)."""
  b, t, h, k, v = shape
  args = make_inputs(seed, shape, dtype)
  mu0 = jnp.zeros((b, h, v, k), jnp.float32)
  p0 = jnp.ones((b, h, v, k), jnp.float32)
  cot = jax.random.normal(jax.random.key(seed + 1000), (b, t, h, v), jnp.float32)
  return args + (mu0, p0), cot


def stage_fn(stage, cfg):
  """The stage's kernel as cfg chooses it, jitted alone (the backward walk without the
  variance's cotangent)."""
  return jax.jit(functools.partial(stages.run, OP_STAGES[stage], cfg))


def stage_args(cfg, args):
  """Each stage's inputs as the op passes them, in STAGES' order, from kernel_inputs' args;
  the walks start from the boundary states cfg's boundary kernel computes."""
  q, k, v, beta, la, ip, mu0, p0 = args
  gates = layout.make_gates(la, None, cfg.h, cfg.t_pad, cfg.chunk)
  ipv = jnp.tile(ip.astype(jnp.float32), cfg.b)
  m0, b0 = forward.initial_linear_state(cfg, mu0, p0, ipv, cfg.k_boundary)
  q_rows, k_rows = (layout.pad_rows(x, cfg.t_pad, cfg.k_pad) for x in (q, k))
  v_rows, beta_rows = (layout.pad_rows(x, cfg.t_pad, cfg.v_pad) for x in (v, beta))
  k_bound = layout.pad_rows(k, cfg.t_pad, cfg.k_boundary - cfg.k)
  bnd = (k_bound, v_rows, beta_rows, gates.to_end, gates.chunk, m0, b0)
  ms, bs, _, _ = stage_fn("boundary", cfg)(*bnd)
  fwd = (q_rows, k_rows, v_rows, beta_rows, gates.step, ipv, ms, bs)
  rows = backward.walk_rows(cfg, q, k, v, beta, jnp.ones_like(v), None)
  bwd = (*rows[:4], gates.step, layout.ip_row(ipv, cfg.k_bwd), rows[4], None,
         backward.walk_starts(cfg, ms), backward.walk_starts(cfg, bs))
  return bnd, fwd, bwd
