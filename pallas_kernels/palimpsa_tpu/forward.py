"""Forward kernels: chunk-boundary states on the MXU, then the per-step walk on the VPU.

1. `boundary_states`: grid (N, V tiles, chunks), chunk axis sequential ("arbitrary"). The state
   at the start of every chunk is carried in VMEM scratch and advanced by two MXU matmuls per
   chunk: M_end = A M_start + (K^T w) V, Ibar_end = A Ibar_start + (K^2 w)^T Beta, with
   w_t = prod_{s>t in chunk} alpha_s and A = prod_{s in chunk} alpha_s.
2. `walk`: grid (N, V tiles, chunks), all parallel. Each program starts from its chunk's boundary
   state and walks the C steps in VMEM: update, one reciprocal per state entry, readout.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.palimpsa_tpu import walk
from pallas_kernels.palimpsa_tpu.layout import LANES, Geometry


def _specs(g: Geometry):
  """BlockSpecs indexed by grid (n, j, c): j a 128-lane value tile, c a chunk."""
  keys = pl.BlockSpec((1, g.kp, g.chunk), lambda n, j, c: (n, 0, c))
  values = pl.BlockSpec((1, g.chunk, LANES), lambda n, j, c: (n, c, j))
  steps = pl.BlockSpec((1, 1, g.chunk), lambda n, j, c: (n, 0, c))
  state = pl.BlockSpec((1, g.kp, LANES), lambda n, j, c: (n, 0, j))
  chunk_state = pl.BlockSpec((1, 1, g.kp, LANES), lambda n, j, c: (n, c, 0, j))
  prior = pl.BlockSpec((1, 1, LANES), lambda n, j, c: (n, 0, j))
  return keys, values, steps, state, chunk_state, prior


def _boundary_kernel(k_ref, v_ref, beta_ref, w_ref, gate_ref, m0_ref, ibar0_ref,
                     m_start_ref, ibar_start_ref, m_end_ref, ibar_end_ref, m_scr, ibar_scr):
  c = pl.program_id(2)

  @pl.when(c == 0)
  def _():
    m_scr[...] = m0_ref[0]
    ibar_scr[...] = ibar0_ref[0]

  m_start_ref[0, 0] = m_scr[...]
  ibar_start_ref[0, 0] = ibar_scr[...]
  k_t = k_ref[0].astype(jnp.float32)                             # [Kp, C]
  w = w_ref[0]                                                   # [1, C]
  first = walk.lane_mask(w.shape, 0)
  decay = walk.column(w * gate_ref[0], first)                    # [1, 1]
  dot = functools.partial(jnp.dot, precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)
  k_w = k_t * w
  m = decay * m_scr[...] + dot(k_w, v_ref[0])
  ibar = decay * ibar_scr[...] + dot(k_t * k_w, beta_ref[0])
  m_scr[...] = m
  ibar_scr[...] = ibar

  @pl.when(c == pl.num_programs(2) - 1)
  def _():
    m_end_ref[0] = m
    ibar_end_ref[0] = ibar


def boundary_states(k_t, v, beta, w, gate, m0, ibar0, g: Geometry, interpret):
  """Chunk-start states and final state.

  k_t [N,Kp,Tp]; v, beta [N,Tp,Vp] f32; w, gate [N,1,Tp] f32; m0, ibar0 [N,Kp,Vp] f32.
  Returns m_start, ibar_start [N, n_chunks, Kp, Vp] and m_end, ibar_end [N, Kp, Vp], float32.
  """
  keys, values, steps, state, chunk_state, _ = _specs(g)
  f32 = jnp.float32
  return pl.pallas_call(
      _boundary_kernel,
      name="palimpsa_tpu_boundary_states",
      grid=(g.n, g.num_vtiles, g.num_chunks),
      in_specs=[keys, values, values, steps, steps, state, state],
      out_specs=[chunk_state, chunk_state, state, state],
      out_shape=[jax.ShapeDtypeStruct((g.n, g.num_chunks, g.kp, g.vp), f32)] * 2
      + [jax.ShapeDtypeStruct((g.n, g.kp, g.vp), f32)] * 2,
      scratch_shapes=[pltpu.VMEM((g.kp, LANES), f32)] * 2,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret,
  )(k_t, v, beta, w, gate, m0, ibar0)


def _walk_kernel(q_ref, k_ref, v_ref, beta_ref, gate_ref, ip_ref, m_ref, ibar_ref, out_ref,
                 *var_ref):
  ip = ip_ref[0]                                                 # [1, BV]
  gates = gate_ref[0]                                            # [1, C]

  def step(t, carry):
    m, ibar = carry
    mask = walk.lane_mask(k_ref.shape[1:], t)
    k_col = walk.column(k_ref[0].astype(jnp.float32), mask)
    q_col = walk.column(q_ref[0].astype(jnp.float32), mask)
    a = walk.column(gates, walk.lane_mask(gates.shape, t))
    m, ibar = walk.advance(m, ibar, a, k_col, walk.row(v_ref, t), walk.row(beta_ref, t))
    r = 1.0 / (ibar + ip)
    out_ref[0, pl.ds(t, 1), :] = jnp.sum(m * r * q_col, axis=0, keepdims=True)
    if var_ref:
      var_ref[0][0, pl.ds(t, 1), :] = jnp.sum(r * (q_col * q_col), axis=0, keepdims=True)
    return m, ibar

  jax.lax.fori_loop(0, q_ref.shape[2], step, (m_ref[0, 0], ibar_ref[0, 0]))


def walk_outputs(q_t, k_t, v, beta, gate, ip, m_start, ibar_start, g: Geometry,
                 return_variance, interpret):
  """Readout (and variance) [N, Tp, Vp] float32 from the chunk-start states."""
  keys, values, steps, _, chunk_state, prior = _specs(g)
  n_out = 2 if return_variance else 1
  outs = pl.pallas_call(
      _walk_kernel,
      name="palimpsa_tpu_walk",
      grid=(g.n, g.num_vtiles, g.num_chunks),
      in_specs=[keys, keys, values, values, steps, prior, chunk_state, chunk_state],
      out_specs=[values] * n_out,
      out_shape=[jax.ShapeDtypeStruct((g.n, g.tp, g.vp), jnp.float32)] * n_out,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel")),
      interpret=interpret,
  )(q_t, k_t, v, beta, gate, ip, m_start, ibar_start)
  return outs[0], (outs[1] if return_variance else None)
