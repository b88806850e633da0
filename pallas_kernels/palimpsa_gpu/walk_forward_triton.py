"""The forward chunk walk as a Pallas (Triton) kernel.

Grid (B*H, chunk, V-tile); each program starts from its chunk-boundary state [BV, Kp]
(float32, in registers) and steps through the chunk one token at a time, reading its rows and
writing readouts in the caller's layout [B, T, H, D]. The state is held as K-parts
([BV, k_part] tensors: Triton shapes are powers of two, so K=48 is three parts of 16 rather
than one padded to 64), and its updates are written as explicit FMAs.
"""

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import fast_reciprocal, fma, k_parts, largest_power_of_two_dividing
from pallas_kernels.palimpsa_gpu import layout
from pallas_kernels.palimpsa_gpu.config import GpuKernelConfig, StageCall
from pallas_kernels.palimpsa_gpu.launch_triton import triton_params

# Loop bodies ahead that a program loads its rows; one hides the load latency.
FORWARD_PREFETCH = 1


def supports(call: StageCall) -> str | None:
  """None: it runs every call the op takes (K, V <= 256, any dtypes, any device)."""
  del call


def block_v_for(v_padded: int, k_part: int, num_warps: int) -> int:
  """V-tile: about 256 state entries per K-part and warp."""
  return min(largest_power_of_two_dividing(v_padded), 256 * num_warps // k_part)


@dataclasses.dataclass(frozen=True)
class WalkForwardTritonTiles:
  """One program per (batch*head, chunk, V-tile of block_v rows) with num_warps warps, K in
  parts of k_part columns, unroll steps per loop body."""

  backend: ClassVar[str] = "triton"
  k_part: int
  block_v: int
  num_warps: int
  unroll: int


def tiles(call: StageCall) -> WalkForwardTritonTiles:
  """The tiles the sweeps of benchmarks/op/tuning.py --op palimpsa chose: K-parts of 8-32
  columns, about 256 state entries per part and warp, two warps for 32-column parts or where
  V lets the tile double, two steps per loop body."""
  k_part = 8 if call.kp == 16 else min(largest_power_of_two_dividing(call.kp), 32)
  num_warps = 2 if (k_part == 32 or block_v_for(call.vp, k_part, 2)
                    > block_v_for(call.vp, k_part, 1)) else 1
  return WalkForwardTritonTiles(k_part=k_part, block_v=block_v_for(call.vp, k_part, num_warps),
               num_warps=num_warps, unroll=2)


def _fma_sum(pairs: list[tuple[jax.Array, jax.Array]], interpret: bool) -> jax.Array:
  """sum of x * y over the (x, y) pairs: one multiply, then FMAs."""
  (x, y), rest = pairs[0], pairs[1:]
  acc = x * y
  for x, y in rest:
    acc = fma(x, y, acc, interpret=interpret)
  return acc



def _forward_kernel(q_ref, k_ref, v_ref, beta_ref, a_ref, ip_ref, m0_ref, b0_ref,
                    *out_refs, chunk, unroll, prefetch, k_part, with_var, interpret):
  """Walks one chunk for one V-tile, writing readouts (and variances).

  The state [BV, Kp] is held as K-parts ([BV, k_part] each) in registers: M and the
  precision I itself (Ibar + Ip), so that I_t = a I + ((1 - a) Ip + beta k^2) is two
  FMAs and r = 1 / I needs no add.
  """
  out_ref = out_refs[0]
  var_ref = out_refs[1] if with_var else None
  parts = k_parts(k_ref.shape[-1], k_part)
  ip = ip_ref[0].astype(jnp.float32)  # The head's prior precision (every column holds it).

  def row(ref, t, p):
    return ref[t, p].astype(jnp.float32)[None, :]

  def load(t0):  # The rows of steps t0 .. t0 + unroll - 1.
    return [([row(k_ref, t0 + s, p) for p in parts],
             [row(q_ref, t0 + s, p) for p in parts],
             v_ref[t0 + s, :].astype(jnp.float32)[:, None],
             beta_ref[t0 + s, :].astype(jnp.float32)[:, None],
             a_ref[t0 + s]) for s in range(unroll)]

  def steps(i, carry):
    ms, bs, queue = carry
    t0 = i * unroll
    # Rows are loaded `prefetch` bodies ahead, so their latency overlaps the arithmetic
    # (the last bodies reload the chunk's last rows, unused).
    rows, queue = queue[0], queue[1:] + [
        load(jnp.minimum(t0 + prefetch * unroll, chunk - unroll))]
    for s, (ks, qs, v, beta, a) in enumerate(rows):
      ms = [fma(a, m, v * k, interpret=interpret) for m, k in zip(ms, ks)]
      prior = (1.0 - a) * ip
      bs = [fma(a, b, fma(beta, k * k, prior, interpret=interpret), interpret=interpret)
            for b, k in zip(bs, ks)]
      rs = [fast_reciprocal(b, interpret=interpret) for b in bs]
      # The K-parts' products are added elementwise by FMAs, then reduced once.
      out = jnp.sum(_fma_sum([(m, r * q) for m, r, q in zip(ms, rs, qs)], interpret), axis=1)
      out_ref[t0 + s, :] = out.astype(out_ref.dtype)
      if with_var:
        var_ref[t0 + s, :] = jnp.sum(
            _fma_sum([(r, q * q) for r, q in zip(rs, qs)], interpret), axis=1)
    return ms, bs, queue

  initial = ([m0_ref[:, p] for p in parts], [b0_ref[:, p] + ip for p in parts],
             [load(j * unroll) for j in range(prefetch)])
  jax.lax.fori_loop(0, chunk // unroll, steps, initial)


def walk_forward(q, k, v, beta, a, ip_row, m_starts, b_starts, *, heads: int,
                 chunk: int, block_v: int, unroll: int, k_part: int, with_var: bool,
                 out_dtype, num_warps: int, interpret: bool):
  """Readouts of every step, written in the caller's layout.

  Args:
    q, k: [B, Tp, H, Kp]; v, beta: [B, Tp, H, Vp] (the caller's layout, padded);
    a: [BH, Tp] step gates;
    ip_row: [BH, Kp] prior precision; m_starts, b_starts: [BH, NC, Vp, Ks] with
    Ks >= Kp (columns past Kp are padding and not read).
    heads: H (batch*head n is batch n // H, head n % H).
    k_part: width of the K-parts (a power of two dividing Kp).
    unroll: steps per loop body (rows are loaded FORWARD_PREFETCH bodies ahead).

  Returns:
    [out [B, Tp, H, Vp] out_dtype] + ([var [B, Tp, H, Vp] f32] if with_var).
  """
  bh, tp = a.shape
  kp, vp, k_state = q.shape[-1], v.shape[-1], m_starts.shape[-1]
  nc, nv = tp // chunk, vp // block_v
  rows = functools.partial(layout.rows_spec, heads, chunk)
  row_k = rows(kp, lambda n, c, j: (n, c, 0))
  row_v = rows(block_v, lambda n, c, j: (n, c, j))
  row_out = layout.rows_spec(heads, chunk, block_v, lambda n, c, j: (n, c, j))
  state = pl.BlockSpec((None, None, block_v, k_state), lambda n, c, j: (n, c, j, 0))
  out_shape = [jax.ShapeDtypeStruct((bh // heads, tp, heads, vp), out_dtype)]
  if with_var:
    out_shape.append(jax.ShapeDtypeStruct((bh // heads, tp, heads, vp), jnp.float32))
  prefetch = FORWARD_PREFETCH
  if chunk < prefetch * unroll:
    raise ValueError(f"unroll={unroll} steps per body, loaded {prefetch} bodies ahead, "
                     f"must fit in chunk={chunk}")
  kernel = functools.partial(_forward_kernel, chunk=chunk, unroll=unroll,
                             prefetch=prefetch, k_part=k_part, with_var=with_var,
                             interpret=interpret)
  return pl.pallas_call(
      kernel, grid=(bh, nc, nv),
      in_specs=[row_k, row_k, row_v, row_v,
                pl.BlockSpec((None, chunk), lambda n, c, j: (n, c)),
                pl.BlockSpec((None, kp), lambda n, c, j: (n, 0)), state, state],
      out_specs=[row_out] * len(out_shape), out_shape=out_shape,
      compiler_params=triton_params(num_warps, interpret), interpret=interpret,
      name="palimpsa_walk_forward",
  )(q, k, v, beta, a, ip_row, m_starts, b_starts)



def launch(cfg: GpuKernelConfig, q, k, v, beta, a, ip, m_starts, b_starts):
  """`walk_forward` with cfg's tiles; ip: [BH] prior precision, the rest as there."""
  own = cfg.walk_fwd
  return walk_forward(q, k, v, beta, a, layout.ip_row(ip, q.shape[-1]), m_starts, b_starts,
                      heads=cfg.h, chunk=cfg.chunk, block_v=own.block_v,
                      unroll=own.unroll, k_part=own.k_part,
                      with_var=cfg.return_variance, out_dtype=v.dtype,
                      num_warps=own.num_warps, interpret=cfg.interpret)
