"""Chunk-boundary states of the linear form (M = mu * I, Ibar = I - Ip) with matmuls.

The Pallas kernel fuses each chunk's write (tensor-core matmuls) with the scan over
chunks; the backward's adjoint carries use the XLA reverse scan.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

_HIGHEST = jax.lax.Precision.HIGHEST


def reverse_scan_chunks(end, chunk_gate: jax.Array, local):
  """Adjoint carries: the adjoint entering each chunk's last step from later steps.

  carry_{NC-1} = end; carry_{c-1} = local_c + chunk_gate_c * carry_c, applied to
  every array of the pytrees `end` and `local` (one scan for all of them).

  Args:
    end: pytree of [BH, Vp, Kp] adjoints of the final state.
    chunk_gate: [BH, NC].
    local: pytree (like end) of [BH, NC, Vp, Kp]: each chunk's own adjoint of the
      state before it.

  Returns:
    (pytree of [BH, NC, Vp, Kp] carries at chunk ends, pytree of [BH, Vp, Kp]
    adjoints of the initial state).
  """

  def step(carry, inputs):
    g, a = inputs
    new = jax.tree.map(lambda x, c: x + g[:, None, None] * c, a, carry)
    return new, carry

  local_t = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), local)
  initial, carries = jax.lax.scan(
      step, end, (jnp.moveaxis(chunk_gate, 1, 0), local_t), reverse=True)
  return jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1), carries), initial


def _dot_precision(interpret: bool):
  # fp32-accurate products on tensor cores (3 TF32 passes); plain f32 on CPU.
  return _HIGHEST if interpret else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _dot_t(x, y, precision):
  """x^T y for x [C, V], y [C, K] -> [V, K] float32."""
  return jax.lax.dot_general(x, y, (((0,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def _boundary_kernel(k_ref, v_ref, beta_ref, w_ref, g_ref, m0_ref, b0_ref,
                     ms_ref, bs_ref, mf_ref, bf_ref, *, chunk, num_chunks, interpret):
  """Sequential over chunks for one (batch*head, V-tile): state += chunk writes.

  The state [BV, Kp] is held as equal K-parts, each the largest power of two that
  divides Kp (Triton tensors have power-of-two shapes; Kp is a multiple of 16).
  """
  precision = _dot_precision(interpret)
  kp = k_ref.shape[-1]
  k_part = kp & -kp
  parts = [pl.ds(i * k_part, k_part) for i in range(kp // k_part)]

  def step(c, carry):
    ms, bs = carry
    for p, m, b in zip(parts, ms, bs):
      ms_ref[c, :, p] = m
      bs_ref[c, :, p] = b
    rows = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
    w = w_ref[rows][:, None]
    vw = v_ref[rows, :].astype(jnp.float32) * w
    bw = beta_ref[rows, :].astype(jnp.float32) * w
    g = g_ref[c]
    ks = [k_ref[rows, p].astype(jnp.float32) for p in parts]
    return ([g * m + _dot_t(vw, k, precision) for m, k in zip(ms, ks)],
            [g * b + _dot_t(bw, k * k, precision) for b, k in zip(bs, ks)])

  ms, bs = jax.lax.fori_loop(0, num_chunks, step, ([m0_ref[:, p] for p in parts],
                                                   [b0_ref[:, p] for p in parts]))
  for p, m, b in zip(parts, ms, bs):
    mf_ref[:, p] = m
    bf_ref[:, p] = b


def boundary_states(k, v, beta, to_end, chunk_gate, m0, b0, *, chunk: int,
                    block_v: int, num_warps: int, interpret: bool):
  """States (M, Ibar) before every chunk and after the last, one Pallas kernel.

  Args:
    k: [BH, Tp, Kp] (Kp a multiple of 16); v, beta: [BH, Tp, Vp]; to_end: [BH, Tp];
    chunk_gate: [BH, NC];
    m0, b0: [BH, Vp, Kp] initial state.

  Returns:
    m_starts, b_starts [BH, NC, Vp, Kp]; m_final, b_final [BH, Vp, Kp]; float32.
  """
  bh, tp, kp = k.shape
  vp = v.shape[-1]
  nc = tp // chunk
  seq_v = pl.BlockSpec((None, tp, block_v), lambda n, j: (n, 0, j))
  state = pl.BlockSpec((None, block_v, kp), lambda n, j: (n, j, 0))
  starts = pl.BlockSpec((None, nc, block_v, kp), lambda n, j: (n, 0, j, 0))
  f32 = jnp.float32
  kernel = functools.partial(_boundary_kernel, chunk=chunk, num_chunks=nc,
                             interpret=interpret)
  params = None if interpret else plgpu_triton.CompilerParams(
      num_warps=num_warps, num_stages=2)
  return pl.pallas_call(
      kernel, grid=(bh, vp // block_v),
      in_specs=[pl.BlockSpec((None, tp, kp), lambda n, j: (n, 0, 0)), seq_v, seq_v,
                pl.BlockSpec((None, tp), lambda n, j: (n, 0)),
                pl.BlockSpec((None, nc), lambda n, j: (n, 0)), state, state],
      out_specs=[starts, starts, state, state],
      out_shape=[jax.ShapeDtypeStruct((bh, nc, vp, kp), f32)] * 2
      + [jax.ShapeDtypeStruct((bh, vp, kp), f32)] * 2,
      compiler_params=params, interpret=interpret, name="palimpsa_boundary",
  )(k, v, beta, to_end, chunk_gate, m0, b0)
