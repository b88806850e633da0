"""The forward chunk walk as a Pallas Mosaic GPU kernel (Hopper and newer).

Same readouts as `walk_forward_triton.walk_forward`. A CTA is one warpgroup: warp w walks
chunk 4g + w of one batch*head for one V-tile of 16 rows over all of K, holding M and the
precision I = Ibar + Ip as K/16 tiles [4, 16, 16] each (`mosaic_tiles.TILE_PER_WARP`: one
[16, 16] tile per warp). A step is, per tile, M = a M + v k, I = a I + ((1 - a) Ip + beta k^2)
(FMAs), r = 1 / I (rcp.approx) and the readout sum_k M r q, whose K-tiles' products each
lane folds into one FMA chain before a reduce-scatter over the warp's lanes
(`mosaic_tiles.readout_stores`).

Rows are read where they lie, in the caller's layout [B, Tp, H, D] viewed as
[B * G, 4, chunk, H, D] (G groups of 4 chunks: a free reshape), one TMA box
[4, SLOT_STEPS, 16] per row, K-tile and slot of SLOT_STEPS steps, through a ring of two
slots; readouts are staged per slot and leave by TMA into [B * G, 4, chunk, H, Vp].
No register waits on global memory inside the walk.
"""

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.palimpsa_gpu.config import GpuKernelConfig, StageCall, mosaic_refusal
from pallas_kernels.palimpsa_gpu.launch_mosaic import mosaic_kernel
from pallas_kernels.palimpsa_gpu.mosaic_tiles import (
    K_ROWS, SMEM_LIMIT, TILE, TILE_PER_WARP, V_ROWS, WALKS, over_k, over_v, pointwise_ops,
    readout_stores, smem_bytes_of)

f32 = jnp.float32
SLOTS = 2  # Slots of the row ring.
SLOT_STEPS = 8  # Steps per ring slot (and per staged block of readouts).
# The widest K held in registers: 8 tiles of M and I take 128 of a thread's registers.
MAX_K = 128
HOPPER_ONLY = False  # Hopper and newer.


def _smem_scratch(kp: int, row_dtypes, out_dtype, with_var: bool) -> list:
  """The kernel's shared memory in `_kernel`'s order: ring slots [2, K/16, 4, S, 16] for
  k and q, [2, 4, S, 16] for v, beta and the gates (S = SLOT_STEPS); the prior precision
  row; the start states of M and Ibar [K/16, 4, 16, 16]; two staging slots for the
  readouts (and the variances)."""
  smem, nk = plgpu.SMEM, kp // TILE
  k_dtype, q_dtype, v_dtype, beta_dtype = row_dtypes
  wide, narrow = (SLOTS, nk, WALKS, SLOT_STEPS, TILE), (SLOTS, WALKS, SLOT_STEPS, TILE)
  staged = [smem(narrow, out_dtype)] + ([smem(narrow, f32)] if with_var else [])
  return ([smem(wide, k_dtype), smem(wide, q_dtype), smem(narrow, v_dtype),
           smem(narrow, beta_dtype), smem(narrow, f32), smem((WALKS, TILE), f32)]
          + [smem((nk, WALKS, TILE, TILE), f32)] * 2 + staged)


def smem_bytes(kp: int, row_dtypes, out_dtype, with_var: bool) -> int:
  """Shared memory of one CTA (row_dtypes: k, q, v, beta)."""
  return smem_bytes_of(_smem_scratch(kp, row_dtypes, out_dtype, with_var))


def supported(chunk: int, kp: int, row_dtypes, out_dtype, with_var: bool, *,
              interpret: bool) -> bool:
  """Whether the chunk cuts into whole slots, K fits in registers and, compiled, the CTA
  fits in shared memory (row_dtypes: k, q, v, beta)."""
  return (chunk % SLOT_STEPS == 0 and kp % TILE == 0 and kp <= MAX_K
          and (interpret or smem_bytes(kp, row_dtypes, out_dtype, with_var) <= SMEM_LIMIT))


def supports(call: StageCall) -> str | None:
  """None where the kernel takes the call's chunk, K and rows (`supported`) on the call's
  device (Hopper and newer), else why not."""
  rows = [call.k_dtype, call.q_dtype, call.v_dtype, call.beta_dtype]
  return mosaic_refusal(supported(call.chunk, call.kp, rows, call.v_dtype, call.with_var,
                                  interpret=call.interpret), call, hopper_only=HOPPER_ONLY)


@dataclasses.dataclass(frozen=True)
class WalkForwardMosaicTiles:
  """None to choose: its tiles are fixed ([16, 16] per warp, 8-step slots)."""

  backend: ClassVar[str] = "mosaic"


def tiles(call: StageCall) -> WalkForwardMosaicTiles:
  del call
  return WalkForwardMosaicTiles()


def _kernel(*refs, chunk, nk, heads, groups, with_var, interpret):
  """One CTA: 4 chunks (one per warp) of one batch*head and V-tile.

  refs: the inputs (k, q, v, beta as [B*G, 4, chunk, H, D]; gates [BH, G, 4, chunk, 16];
  ip [BH, 4, 16]; start states [BH, G*4, Vp, Ks]), the readouts (and variances)
  [B*G, 4, chunk, H, Vp], then the scratch of `_smem_scratch` and the ring and start
  barriers.
  """
  n_out = 2 if with_var else 1
  (k_g, q_g, v_g, beta_g, a_g, ip_g, m0_g, b0_g), outs = refs[:8], refs[8:8 + n_out]
  scratch = refs[8 + n_out:]
  k_s, q_s, v_s, beta_s, a_s, ip_s, m0_s, b0_s = scratch[:8]
  staged, (ring_bars, start_bar) = scratch[8:8 + n_out], scratch[8 + n_out:]
  fma, reciprocal = pointwise_ops(interpret)
  readout = readout_stores(interpret)
  slots_per_chunk = chunk // SLOT_STEPS

  vt, g, n = (jax.lax.axis_index(name) for name in ("v", "g", "n"))
  bg, h = (n // heads) * groups + g, n % heads
  vcols, walks = pl.ds(vt * TILE, TILE), pl.ds(g * WALKS, WALKS)
  ktiles = [pl.ds(j * TILE, TILE) for j in range(nk)]
  plgpu.copy_gmem_to_smem(ip_g.at[n], ip_s, start_bar)
  for j, cols in enumerate(ktiles):
    plgpu.copy_gmem_to_smem(m0_g.at[n, walks, vcols, cols], m0_s.at[j], start_bar)
    plgpu.copy_gmem_to_smem(b0_g.at[n, walks, vcols, cols], b0_s.at[j], start_bar)

  def fetch(i):  # Slot i's rows (steps i*S ..) into ring slot i % 2.
    slot, steps = i % SLOTS, pl.ds(i * SLOT_STEPS, SLOT_STEPS)
    bar = ring_bars.at[slot]
    for j, cols in enumerate(ktiles):
      plgpu.copy_gmem_to_smem(k_g.at[bg, :, steps, h, cols], k_s.at[slot, j], bar)
      plgpu.copy_gmem_to_smem(q_g.at[bg, :, steps, h, cols], q_s.at[slot, j], bar)
    plgpu.copy_gmem_to_smem(v_g.at[bg, :, steps, h, vcols], v_s.at[slot], bar)
    plgpu.copy_gmem_to_smem(beta_g.at[bg, :, steps, h, vcols], beta_s.at[slot], bar)
    plgpu.copy_gmem_to_smem(a_g.at[n, g, :, steps], a_s.at[slot], bar)

  fetch(0)
  if slots_per_chunk > 1:
    fetch(1)

  def row(ref, layout):
    return plgpu.load(ref, layout=layout).astype(f32)

  plgpu.barrier_wait(start_bar)
  ip = row(ip_s, V_ROWS)
  ip_tile = over_v(ip)
  ms = [plgpu.load(m0_s.at[j], layout=TILE_PER_WARP) for j in range(nk)]
  bs = [plgpu.load(b0_s.at[j], layout=TILE_PER_WARP) + ip_tile for j in range(nk)]

  def walk_slot(i, carry):
    ms, bs = carry
    slot = i % SLOTS
    plgpu.barrier_wait(ring_bars.at[slot])
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # This staging slot's last copy.
    # The slot's steps as a loop, not unrolled: one step's code keeps instruction fetch off
    # the walk's stalls and shortens the compile.
    def step(s, carry):
      ms, bs = carry
      ms, bs = list(ms), list(bs)
      a_row = row(a_s.at[slot, :, s], V_ROWS)
      a, prior = over_v(a_row), over_v((1.0 - a_row) * ip)
      v = over_v(row(v_s.at[slot, :, s], V_ROWS))
      beta = over_v(row(beta_s.at[slot, :, s], V_ROWS))
      rqs, rs, q2s = [], [], []
      for j in range(nk):
        k_row = row(k_s.at[slot, j, :, s], K_ROWS)
        q_row = row(q_s.at[slot, j, :, s], K_ROWS)
        k, k2, q = over_k(k_row), over_k(k_row * k_row), over_k(q_row)
        ms[j] = fma(a, ms[j], v * k)
        bs[j] = fma(a, bs[j], fma(beta, k2, prior))
        r = reciprocal(bs[j])
        rqs.append(r * q)
        if with_var:
          rs.append(r)
          q2s.append(over_k(q_row * q_row))
      readout(ms, rqs, staged[0].at[slot, :, s])
      if with_var:
        readout(rs, q2s, staged[1].at[slot, :, s])
      return ms, bs

    ms, bs = jax.lax.fori_loop(0, SLOT_STEPS, step, (ms, bs))
    plgpu.commit_smem()  # Every warp is done with the ring slot and has staged its readouts.
    steps = pl.ds(i * SLOT_STEPS, SLOT_STEPS)
    for j, (src, dst) in enumerate(zip(staged, outs)):
      plgpu.copy_smem_to_gmem(src.at[slot], dst.at[bg, :, steps, h, vcols],
                              commit_group=j == n_out - 1)

    @pl.when(i + SLOTS < slots_per_chunk)
    def _():
      fetch(i + SLOTS)
    return ms, bs

  jax.lax.fori_loop(0, slots_per_chunk, walk_slot, (ms, bs))
  plgpu.wait_smem_to_gmem(0)


def walk_forward(q, k, v, beta, a, ip, m_starts, b_starts, *, heads: int, chunk: int,
                 with_var: bool, out_dtype, interpret: bool):
  """Readouts of every step, written in the caller's layout.

  Args:
    q, k: [B, Tp, H, Kp]; v, beta: [B, Tp, H, Vp] (the caller's layout, padded; Kp and
      Vp multiples of 16, Tp of chunk); a: [BH, Tp] step gates; ip: [BH] prior
      precision; m_starts, b_starts: [BH, NC, Vp, Ks] with Ks >= Kp (columns past Kp
      are not read). `supported(chunk, Kp, ...)` holds.
    heads: H (batch*head n is batch n // H, head n % H).

  Returns:
    [out [B, Tp, H, Vp] out_dtype] + ([var [B, Tp, H, Vp] f32] if with_var).
  """
  b, tp, _, kp = q.shape
  vp, bh = v.shape[-1], a.shape[0]
  nc, nk, nv = tp // chunk, kp // TILE, vp // TILE
  groups = -(-nc // WALKS)
  t_all = groups * WALKS * chunk
  row_dtypes = [k.dtype, q.dtype, v.dtype, beta.dtype]
  if not supported(chunk, kp, row_dtypes, out_dtype, with_var, interpret=interpret):
    raise ValueError(f"chunk={chunk}, K={kp} with rows of "
                     f"{[jnp.dtype(d).name for d in row_dtypes]} do not fit the kernel")

  def rows(x):  # [B, Tp, H, D] -> [B*G, 4, chunk, H, D] (a copy only where Tp pads).
    if t_all != tp:
      x = jnp.pad(x, ((0, 0), (0, t_all - tp), (0, 0), (0, 0)))
    return x.reshape(b * groups, WALKS, chunk, heads, x.shape[-1])

  def states(x):  # [BH, NC, Vp, Ks] -> [BH, G*4, Vp, Ks].
    if groups * WALKS != nc:
      x = jnp.pad(x, ((0, 0), (0, groups * WALKS - nc), (0, 0), (0, 0)))
    return x

  gates = jnp.pad(a.astype(f32), ((0, 0), (0, t_all - tp)), constant_values=1.0)
  gates = jnp.broadcast_to(gates[..., None], gates.shape + (TILE,))
  ins = [rows(k), rows(q), rows(v), rows(beta),
         gates.reshape(bh, groups, WALKS, chunk, TILE),
         jnp.broadcast_to(ip.astype(f32)[:, None, None], (bh, WALKS, TILE)),
         states(m_starts), states(b_starts)]
  out_types = [jax.ShapeDtypeStruct((b * groups, WALKS, chunk, heads, vp), out_dtype)]
  if with_var:
    out_types.append(jax.ShapeDtypeStruct(out_types[0].shape, f32))
  scratch = _smem_scratch(kp, row_dtypes, out_dtype, with_var) + [
      plgpu.Barrier(num_arrivals=2 * nk + 3, num_barriers=SLOTS),
      plgpu.Barrier(num_arrivals=2 * nk + 1)]
  # No automatic barriers: every thread reads back only what a TMA copy brought in after a
  # barrier; staged readouts leave through commit_smem.
  kernel = mosaic_kernel(
      functools.partial(_kernel, chunk=chunk, nk=nk, heads=heads, groups=groups,
                        with_var=with_var, interpret=interpret),
      out_type=out_types, scratch_types=scratch, grid=(nv, groups, bh),
      grid_names=("v", "g", "n"), interpret=interpret, name="palimpsa_walk_forward_mosaic")
  outs = kernel(*ins)
  return [x.reshape(b, t_all, heads, vp)[:, :tp] for x in outs]


def launch(cfg: GpuKernelConfig, q, k, v, beta, a, ip, m_starts, b_starts):
  """`walk_forward` for cfg's call (arguments as there)."""
  return walk_forward(q, k, v, beta, a, ip, m_starts, b_starts, heads=cfg.h, chunk=cfg.chunk,
                      with_var=cfg.return_variance, out_dtype=v.dtype, interpret=cfg.interpret)
