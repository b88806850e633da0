"""Chunk-boundary states (`boundary_triton.boundary_states`) as one Pallas Mosaic GPU kernel
(TMA and wgmma: Hopper, sm_90, only; Blackwell's tensor cores take tcgen05 instead).

One CTA (a warpgroup) walks the chunks of one (batch*head, V-tile of 64 rows, K-part) for
one state: M (writes v (x) k) in the first half of the CTAs, Ibar (writes beta (x) k^2)
in the second. The state is a float32 register tile [64, K-part] in the WGMMA layout:

- Rows come by TMA in blocks of R = max(chunk, 64) steps (one or more whole chunks) into
  a ring of `slots` slots: k [R, K-part], v or beta [R, 64] and the block's gates (the
  steps' decays to their chunk's end, then the chunks' decays), issued `slots` blocks
  ahead.
- Per block, y = w k^p [R, K-part] (float32, registers) is split into three bfloat16
  terms in shared memory (`common.bf16_terms`). Per chunk, the chunk's write x^T y goes to
  the tensor cores (wgmma into a fresh accumulator, x [chunk, 64] the transposed A
  operand; products of bfloat16 terms are exact, the sums float32), the start state is
  stored (staging slot, TMA to the chunk's start) meanwhile, and then state = g state +
  write. float32 v or beta rows are split into three bfloat16 terms as well (six
  products, those of term pairs i + j <= 2).
- A V-tile past Vp reads zeros and its rows beyond Vp are not stored (TMA bounds).
"""

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import bf16_terms, round_up
from pallas_kernels.palimpsa_gpu.config import GpuKernelConfig, StageCall, mosaic_refusal
from pallas_kernels.palimpsa_gpu.launch_mosaic import mosaic_kernel
from pallas_kernels.palimpsa_gpu.mosaic_tiles import SMEM_LIMIT, smem_bytes_of

f32, bf16 = jnp.float32, jnp.bfloat16
BLOCK_V = 64  # V-rows per CTA: the M of one wgmma.
MIN_ROWS = 64  # Rows per block at least (the WGMMA register layout's 64-row tiles).
# Row blocks in flight (the ring's slots) by default: two already hide the loads behind
# the chunk writes, a third only takes shared memory (the boundary sweep's record).
SLOTS = 2
# The widest K-part a CTA takes by default: wider parts share each block's v and beta loads
# over more columns until the accumulator's registers run out (the boundary sweep's record).
MAX_DEFAULT_K_PART = 96
TERMS = 3  # bfloat16 terms of a float32 operand.
HOPPER_ONLY = True  # wgmma is Hopper's (sm_90); Blackwell's tensor cores take tcgen05.
GATE_PAD = 32  # Chunk-gate entries per block (at most 4 used): copies of whole 128 bytes.


def default_k_part(kp: int) -> int:
  """The widest multiple of 16 dividing Kp, up to MAX_DEFAULT_K_PART."""
  return max(p for p in range(16, min(kp, MAX_DEFAULT_K_PART) + 1, 16) if kp % p == 0)


def block_rows(chunk: int) -> int:
  """Steps per row block: whole chunks, at least MIN_ROWS."""
  return max(chunk, MIN_ROWS)


def _tiled(dtype, *widths: int):
  """Transforms of a [rows, width] tile in shared memory: the largest swizzle whose tile
  (8, S) divides every width (a TMA copy's global minor dimension among them)."""
  size = jnp.dtype(dtype).itemsize
  swizzle = min(plgpu.find_swizzle(w * size * 8) for w in widths)
  return (plgpu.TilingTransform((8, swizzle // size)), plgpu.SwizzleTransform(swizzle))


def _scratch(chunk: int, k_part: int, vp: int, slots: int, k_dtype, x_dtype) -> list:
  """Shared memory in `_kernel`'s order: ring slots of k, x and gates; y's bfloat16 terms;
  two staging slots of the state; with float32 x, x's bfloat16 terms.

  The wgmma operands (bfloat16 x or its terms [rows, 64], y's terms [rows, k_part]) share
  one swizzle, whose S divides the chunk (the contraction) and, for x copied from global
  memory, Vp.
  """
  rows = block_rows(chunk)
  exact = jnp.dtype(x_dtype) == bf16
  ops = _tiled(bf16, k_part, chunk, BLOCK_V, *([vp] if exact else []))
  smem = plgpu.SMEM
  return [
      smem((slots, rows, k_part), k_dtype, transforms=_tiled(k_dtype, k_part)),
      smem((slots, rows, BLOCK_V), x_dtype,
           transforms=ops if exact else _tiled(x_dtype, BLOCK_V, vp)),
      smem((slots, rows + GATE_PAD), f32),
      smem((TERMS, rows, k_part), bf16, transforms=ops),
      smem((2, BLOCK_V, k_part), f32, transforms=_tiled(f32, k_part)),
  ] + ([] if exact else [smem((TERMS, rows, BLOCK_V), bf16, transforms=ops)])


def smem_bytes(chunk: int, k_part: int, vp: int, k_dtype, x_dtype, slots: int = SLOTS) -> int:
  """Shared memory of one CTA (x_dtype: of v and beta)."""
  return smem_bytes_of(_scratch(chunk, k_part, vp, slots, k_dtype, x_dtype))


def supported(chunk: int, k_part: int, vp: int, k_dtype, x_dtype, *, interpret: bool,
              slots: int = SLOTS) -> bool:
  """Whether the kernel takes these tiles: a chunk of 16-128 steps (a power of two), a
  K-part of a multiple of 16 columns and, compiled, a CTA that fits in shared memory
  (x_dtype: of v and beta)."""
  return (chunk in (16, 32, 64, 128) and k_part % 16 == 0 and 0 < k_part <= 256
          and slots >= 1 and (interpret or smem_bytes(chunk, k_part, vp, k_dtype, x_dtype,
                                                      slots) <= SMEM_LIMIT))


def _x_dtype(v_dtype, beta_dtype):
  """The dtype the kernel reads v and beta in (`boundary_states` converts them): theirs, or
  float32 where they differ."""
  return v_dtype if jnp.dtype(v_dtype) == jnp.dtype(beta_dtype) else f32


def supports(call: StageCall) -> str | None:
  """None where the kernel takes the call with its default K-part (`supported`) on the
  call's device (Hopper, sm_90), else why not."""
  return mosaic_refusal(
      supported(call.chunk, default_k_part(call.kp), call.vp, call.k_dtype,
                _x_dtype(call.v_dtype, call.beta_dtype), interpret=call.interpret),
      call, hopper_only=HOPPER_ONLY)


@dataclasses.dataclass(frozen=True)
class BoundaryMosaicTiles:
  """One CTA per (batch*head, V-tile of BLOCK_V rows, K-part of k_part columns), M and Ibar
  in one launch; K is padded to a multiple of k_part."""

  backend: ClassVar[str] = "mosaic"
  k_part: int

  def k_width(self, kp: int) -> int:
    """K width of the kernel and of the states it writes, for K padded to kp."""
    return round_up(kp, self.k_part)


def tiles(call: StageCall) -> BoundaryMosaicTiles:
  """One K-part as wide as `default_k_part` allows."""
  return BoundaryMosaicTiles(k_part=default_k_part(call.kp))


def _kernel(k_g, v_g, beta_g, gates_g, m0_g, b0_g, ms_g, bs_g, mf_g, bf_g, k_s, x_s, gate_s,
            y_s, out_s, *rest, heads, chunk, num_blocks, num_chunks, num_v, num_k):
  """One CTA: the walk of one state over all chunks of one (n, V-tile, K-part).

  k_g [B, Tp, H, Kp]; v_g, beta_g [B, Tp, H, Vp]; gates_g [BH, NB, R + GATE_PAD];
  m0_g, b0_g [BH, Vp, Kp]; outputs ms_g, bs_g [BH, NC, Vp, Kp], mf_g, bf_g [BH, Vp, Kp];
  then the scratch of `_scratch` (x's terms last, float32 x only) and the ring and
  init barriers. CTAs p < num_v * num_k walk M (x = v), the others Ibar (x = beta).
  """
  xt_s, ring_bars, init_bar = rest if len(rest) == 3 else (None, *rest)
  slots, rows, k_part = k_s.shape
  per_block = rows // chunk
  p, n = jax.lax.axis_index("p"), jax.lax.axis_index("n")
  tiles = num_v * num_k
  walks_ibar = p >= tiles
  tile = p % tiles
  vrows = pl.ds((tile % num_v) * BLOCK_V, BLOCK_V)
  kcols = pl.ds((tile // num_v) * k_part, k_part)
  batch, head = n // heads, n % heads

  def per_state(fn, m_ref, b_ref):
    """fn(ref) with this CTA's state's ref."""
    pl.when(jnp.logical_not(walks_ibar))(lambda: fn(m_ref))
    pl.when(walks_ibar)(lambda: fn(b_ref))

  def fetch(blk):
    slot, steps = blk % slots, pl.ds(blk * rows, rows)
    bar = ring_bars.at[slot]
    plgpu.copy_gmem_to_smem(k_g.at[batch, steps, head, kcols], k_s.at[slot], bar)
    per_state(lambda x_g: plgpu.copy_gmem_to_smem(
        x_g.at[batch, steps, head, vrows], x_s.at[slot], bar), v_g, beta_g)
    plgpu.copy_gmem_to_smem(gates_g.at[n, blk], gate_s.at[slot], bar)

  per_state(lambda init_g: plgpu.copy_gmem_to_smem(
      init_g.at[n, vrows, kcols], out_s.at[0], init_bar), m0_g, b0_g)
  for blk in range(min(slots, num_blocks)):
    fetch(blk)

  if xt_s is None:  # bfloat16 x: one exact term.
    pairs = [(0, i) for i in reversed(range(TERMS))]
  else:
    pairs = sorted(((i, j) for i in range(TERMS) for j in range(TERMS) if i + j < TERMS),
                   key=lambda ij: -sum(ij))
  # y = w k * (k for Ibar, 1 for M), exact either way: k * s + (1 - s) with s in {0, 1}.
  second = walks_ibar.astype(f32)

  plgpu.barrier_wait(init_bar)
  initial = plgpu.load(out_s.at[0], layout=plgpu.Layout.WGMMA)

  def block(blk, state):
    slot = blk % slots
    plgpu.barrier_wait(ring_bars.at[slot])
    k = plgpu.load(k_s.at[slot], layout=plgpu.Layout.WGMMA).astype(f32)
    w = plgpu.load(gate_s.at[slot, pl.ds(0, rows)], layout=plgpu.Layout.WGMMA.reduce(1))
    y = jax.lax.broadcast_in_dim(w, (rows, k_part), (0,)) * k
    y = y * (k * second + (1.0 - second))
    for i, term in enumerate(bf16_terms(y, TERMS)):
      y_s[i] = term
    if xt_s is not None:
      x = plgpu.load(x_s.at[slot], layout=plgpu.Layout.WGMMA)
      for i, term in enumerate(bf16_terms(x, TERMS)):
        xt_s[i] = term
    x_terms = [x_s.at[slot]] if xt_s is None else [xt_s.at[i] for i in range(TERMS)]
    plgpu.commit_smem()
    for j in range(per_block):
      c = blk * per_block + j
      steps = pl.ds(j * chunk, chunk)

      def chunk_write(acc):
        for i, t in pairs:  # Issued first: the start state's store overlaps them.
          plgpu.wgmma(acc, x_terms[i].at[steps].transpose((1, 0)), y_s.at[t, steps])

        @pl.when(c < num_chunks)  # Not the chunks that pad the last block.
        def _():
          plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # The slot's copy 2 chunks ago.
          out_s[c % 2] = state
          plgpu.commit_smem()
          per_state(lambda starts_g: plgpu.copy_smem_to_gmem(
              out_s.at[c % 2], starts_g.at[n, c, vrows, kcols]), ms_g, bs_g)
        return acc[...]

      write = pl.run_scoped(chunk_write, plgpu.ACC((BLOCK_V, k_part), f32))
      state = gate_s[slot, rows + j] * state + write
    plgpu.commit_smem()  # Every thread is done with the slot before it is refilled.
    if num_blocks > slots:
      @pl.when(blk + slots < num_blocks)
      def _():
        fetch(blk + slots)
    return state

  state = jax.lax.fori_loop(0, num_blocks, block, initial)
  plgpu.wait_smem_to_gmem(1, wait_read_only=True)
  last = num_chunks % 2
  out_s[last] = state
  plgpu.commit_smem()
  per_state(lambda final_g: plgpu.copy_smem_to_gmem(
      out_s.at[last], final_g.at[n, vrows, kcols]), mf_g, bf_g)
  plgpu.wait_smem_to_gmem(0)


def _block_gates(to_end, chunk_gate, rows: int, chunk: int):
  """[BH, NB, rows + GATE_PAD]: each block's to_end rows, then its chunks' gates (1 past
  the last chunk: the state is carried unchanged to the end)."""
  bh, tp = to_end.shape
  nb = -(-tp // rows)
  per_block = rows // chunk
  w = jnp.pad(to_end.astype(f32), ((0, 0), (0, nb * rows - tp)))
  g = jnp.pad(chunk_gate.astype(f32), ((0, 0), (0, nb * per_block - chunk_gate.shape[1])),
              constant_values=1.0)
  g = jnp.pad(g.reshape(bh, nb, per_block), ((0, 0), (0, 0), (0, GATE_PAD - per_block)))
  return jnp.concatenate([w.reshape(bh, nb, rows), g], axis=-1)


def boundary_states(k, v, beta, to_end, chunk_gate, m0, b0, *, heads: int, chunk: int,
                    k_part: int, interpret, slots: int = SLOTS):
  """States (M, Ibar) before every chunk and after the last: `boundary_triton.boundary_states`
  on tensor cores, one Mosaic GPU kernel.

  Args:
    k: [B, Tp, H, Kp]; v, beta: [B, Tp, H, Vp] (the caller's layout, padded; bfloat16
      or float32, taken as float32 both where they differ); to_end: [BH, Tp];
      chunk_gate: [BH, NC]; m0, b0: [BH, Vp, Kp].
    heads: H (batch*head n is batch n // H, head n % H).
    chunk: steps per chunk (16, 32, 64 or 128); Tp a multiple of it.
    k_part: K-columns per CTA, a multiple of 16 dividing Kp.
    interpret: False (compiled), True, or the interpreter's parameters
      (`plgpu.InterpretGPUParams`, e.g. with detect_races).
    slots: row blocks in flight per CTA (at least 1).
    `supported(chunk, k_part, Vp, k.dtype, v.dtype, ...)` must hold.

  Returns:
    m_starts, b_starts [BH, NC, Vp, Kp]; m_final, b_final [BH, Vp, Kp]; float32.
  """
  tp, kp, vp = k.shape[1], k.shape[-1], v.shape[-1]
  if v.dtype != beta.dtype:
    v, beta = v.astype(f32), beta.astype(f32)
  if kp % k_part or tp % chunk or not supported(chunk, k_part, vp, k.dtype, v.dtype,
                                                interpret=bool(interpret), slots=slots):
    raise ValueError(
        f"chunk={chunk}, k_part={k_part}, slots={slots} with K={kp}, V={vp}, Tp={tp} and "
        f"{jnp.dtype(k.dtype).name} k, {jnp.dtype(v.dtype).name} v do not fit the kernel")
  rows = block_rows(chunk)
  num_chunks = tp // chunk
  if tp % rows:  # Whole blocks of rows (zero writes past Tp).
    pad = lambda x: jnp.pad(x, ((0, 0), (0, rows - tp % rows), (0, 0), (0, 0)))
    k, v, beta = pad(k), pad(v), pad(beta)
  gates = _block_gates(to_end, chunk_gate, rows, chunk)
  bh, num_blocks = gates.shape[:2]
  num_v, num_k = -(-vp // BLOCK_V), kp // k_part
  sds = jax.ShapeDtypeStruct
  # No automatic barriers: every thread reads back from shared memory only what it wrote
  # itself (the same layout), or what a TMA copy brought in after a barrier; the tensor
  # cores read after commit_smem; slots are refilled after commit_smem.
  kernel = mosaic_kernel(
      functools.partial(_kernel, heads=heads, chunk=chunk, num_blocks=num_blocks,
                        num_chunks=num_chunks, num_v=num_v, num_k=num_k),
      out_type=[sds((bh, num_chunks, vp, kp), f32)] * 2 + [sds((bh, vp, kp), f32)] * 2,
      scratch_types=_scratch(chunk, k_part, vp, slots, k.dtype, v.dtype) + [
          plgpu.Barrier(num_arrivals=3, num_barriers=slots), plgpu.Barrier(num_arrivals=1)],
      grid=(2 * num_v * num_k, bh), grid_names=("p", "n"), interpret=interpret,
      name="palimpsa_boundary_mosaic")
  return tuple(kernel(k, v, beta, gates, m0.astype(f32), b0.astype(f32)))


def launch(cfg: GpuKernelConfig, k, v, beta, to_end, chunk_gate, m0, b0):
  """`boundary_states` with cfg's K-part (arguments as there)."""
  return boundary_states(k, v, beta, to_end, chunk_gate, m0, b0, heads=cfg.h, chunk=cfg.chunk,
                         k_part=cfg.boundary_fwd.k_part, interpret=cfg.interpret)
