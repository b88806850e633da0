"""Chunk-boundary states of the linear form (M = mu * I, Ibar = I - Ip) as a Pallas
(Triton) kernel: each chunk's write (tensor-core matmuls) fused with the scan over chunks.

The backward's adjoint carries, the same scan in reverse without writes, are in
`carries_triton`.
"""

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import bf16_terms, largest_power_of_two_dividing, round_up
from pallas_kernels.palimpsa_gpu import layout
from pallas_kernels.palimpsa_gpu.config import GpuKernelConfig, StageCall, largest_block_v
from pallas_kernels.palimpsa_gpu.launch_triton import triton_params

_HIGHEST = jax.lax.Precision.HIGHEST
# Triton software-pipelining stages of the chunk loop: two overlap the next chunk's loads
# with this chunk's products, more only take shared memory.
_NUM_STAGES = 2


def supports(call: StageCall) -> str | None:
  """None: it runs every call the op takes (K, V <= 256, any dtypes, any device)."""
  del call


@dataclasses.dataclass(frozen=True)
class BoundaryTritonTiles:
  """One program per (batch*head, V-tile of block_v rows, K-part of k_part columns, M or
  Ibar), with num_warps warps; K is padded to a multiple of k_part (Triton tensors have
  power-of-two shapes)."""

  backend: ClassVar[str] = "triton"
  k_part: int
  block_v: int
  num_warps: int

  def k_width(self, kp: int) -> int:
    """K width of the kernel and of the states it writes, for K padded to kp."""
    return round_up(kp, self.k_part)


def tiles(call: StageCall) -> BoundaryTritonTiles:
  """The tiles the sweeps of benchmarks/op/tuning.py --op palimpsa chose: one program per
  K-part of the largest power of two dividing K up to 32 columns (no padding) and V-tile of
  up to 2048 entries, a warp per 512 entries."""
  k_part = min(largest_power_of_two_dividing(call.kp), 32)
  block_v = largest_block_v(call.vp, k_part, 2048, minimum=16)
  return BoundaryTritonTiles(k_part=k_part, block_v=block_v, num_warps=max(1, block_v * k_part // 512))


def dot_precision(interpret: bool):
  """float32-accurate products on tensor cores (3 TF32 passes); plain f32 on CPU."""
  return _HIGHEST if interpret else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _dot_t(x, y, precision):
  """x^T y for x [C, V], y [C, K] -> [V, K] float32."""
  return jax.lax.dot_general(x, y, (((0,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def _chunk_write(x, y, *, exact_bf16: bool, interpret: bool):
  """x^T y [BV, Kpart] float32-accurate, for x [C, BV] (input dtype), y [C, Kpart] f32.

  With exact_bf16 (x is bfloat16, so exactly representable) y is split into three
  bfloat16 terms and each product runs on bfloat16 tensor cores (exact products, f32
  accumulation); otherwise one 3xTF32 dot.
  """
  if exact_bf16:
    terms = bf16_terms(y)
    return sum(_dot_t(x, t, None) for t in reversed(terms))
  return _dot_t(x.astype(jnp.float32), y, dot_precision(interpret))


def _boundary_kernel(k_ref, v_ref, beta_ref, w_ref, g_ref, m0_ref, b0_ref,
                     ms_ref, bs_ref, mf_ref, bf_ref, *, chunk, num_chunks, exact_bf16,
                     interpret):
  """Sequential over chunks for one (batch*head, V-tile, K-part, state): state += chunk
  writes.

  Program axis 3 picks the state: 0 walks M (writes v (x) k), 1 walks Ibar (writes
  beta (x) k^2), in separate programs (fewer registers, twice the programs).
  """
  write = functools.partial(_chunk_write, exact_bf16=exact_bf16, interpret=interpret)

  def walk(init_refs, value_refs, powers, start_refs, final_refs):
    def step(c, states):
      for state, ref in zip(states, start_refs):
        ref[c] = state
      rows = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
      k = k_ref[rows, :].astype(jnp.float32)
      wk = w_ref[rows][:, None] * k
      g = g_ref[c]
      return tuple(
          g * state + write(ref[rows, :], wk * k if power == 2 else wk)
          for state, ref, power in zip(states, value_refs, powers))

    finals = jax.lax.fori_loop(0, num_chunks, step, tuple(r[...] for r in init_refs))
    for state, ref in zip(finals, final_refs):
      ref[...] = state

  both = ((m0_ref, b0_ref), (v_ref, beta_ref), (1, 2), (ms_ref, bs_ref), (mf_ref, bf_ref))
  for which in (0, 1):
    @pl.when(pl.program_id(3) == which)
    def _():
      walk(*(pair[which:which + 1] for pair in both))


def boundary_states(k, v, beta, to_end, chunk_gate, m0, b0, *, heads: int, chunk: int,
                    block_v: int, k_part: int, num_warps: int, interpret: bool):
  """States (M, Ibar) before every chunk and after the last, one Pallas kernel.

  Grid (batch*head, V-tile, K-part, state): each program walks the chunks in order.
  With bfloat16 v and beta, the chunk writes are bfloat16 tensor-core products (exact)
  of v or beta with w * k^p split into three bfloat16 terms (faster than the 3xTF32
  that float32 rows use).

  Args:
    k: [B, Tp, H, Kp]; v, beta: [B, Tp, H, Vp] (the caller's layout, padded);
    to_end: [BH, Tp]; chunk_gate: [BH, NC]; m0, b0: [BH, Vp, Kp] initial state.
    heads: H (batch*head n is batch n // H, head n % H).
    block_v, k_part: V-tile and K-part (powers of two dividing Vp and Kp).

  Returns:
    m_starts, b_starts [BH, NC, Vp, Kp]; m_final, b_final [BH, Vp, Kp]; float32.
  """
  bh, tp = to_end.shape
  kp, vp = k.shape[-1], v.shape[-1]
  if vp % block_v or kp % k_part:
    raise ValueError(f"block_v={block_v} must divide V={vp} and k_part={k_part} K={kp}")
  nc = tp // chunk
  grid = (bh, vp // block_v, kp // k_part, 2)
  seq_k = layout.rows_spec(heads, tp, k_part, lambda n, j, p, *_: (n, 0, p))
  seq_v = layout.rows_spec(heads, tp, block_v, lambda n, j, p, *_: (n, 0, j))
  state = pl.BlockSpec((None, block_v, k_part), lambda n, j, p, *_: (n, j, p))
  starts = pl.BlockSpec((None, nc, block_v, k_part), lambda n, j, p, *_: (n, 0, j, p))
  f32 = jnp.float32
  exact_bf16 = v.dtype == beta.dtype == jnp.bfloat16
  kernel = functools.partial(_boundary_kernel, chunk=chunk, num_chunks=nc,
                             exact_bf16=exact_bf16, interpret=interpret)
  return pl.pallas_call(
      kernel, grid=grid,
      in_specs=[seq_k, seq_v, seq_v,
                pl.BlockSpec((None, tp), lambda n, *_: (n, 0)),
                pl.BlockSpec((None, nc), lambda n, *_: (n, 0)), state, state],
      out_specs=[starts, starts, state, state],
      out_shape=[jax.ShapeDtypeStruct((bh, nc, vp, kp), f32)] * 2
      + [jax.ShapeDtypeStruct((bh, vp, kp), f32)] * 2,
      compiler_params=triton_params(num_warps, interpret, _NUM_STAGES), interpret=interpret,
      name="palimpsa_boundary",
  )(k, v, beta, to_end, chunk_gate, m0, b0)


def launch(cfg: GpuKernelConfig, k, v, beta, to_end, chunk_gate, m0, b0):
  """`boundary_states` with cfg's tiles (arguments as there)."""
  own = cfg.boundary_fwd
  return boundary_states(k, v, beta, to_end, chunk_gate, m0, b0, heads=cfg.h, chunk=cfg.chunk,
                         block_v=own.block_v, k_part=own.k_part,
                         num_warps=own.num_warps, interpret=cfg.interpret)
