"""The backward chunk walk as a Pallas Mosaic GPU kernel (Hopper and newer).

Same outputs as `walk_backward_triton.walk_backward` with [16, 16] state tiles (one V-tile of
16 rows and one K-slice of 16 columns per walk, sub-chunks of `sub` steps). What differs is
where the data lives:

- A CTA is one warpgroup; warp w walks chunk 4g + w, so the CTA holds its state and
  adjoints as [4, 16, 16] arrays in a layout that gives each warp its own [16, 16] tile
  (`mosaic_tiles.TILE_PER_WARP`), and every per-step sum is a warp-shuffle reduction
  inside a warp.
- Rows come by TMA into a ring of two slots (`slot_steps`: a quarter chunk, or one
  checkpoint segment where only that lets two CTAs share an SM): all the chunk's slots on
  the checkpoint pass, then the last two are still resident for the reverse pass and the
  others are fetched again. Checkpoints (every `every` steps; a segment's later sub-chunks
  re-advance from it) stay in shared memory; outputs are staged per sub-chunk and leave by
  TMA. No register ever waits on global memory inside the walk. In chunks of 64 a CTA
  takes ~105 KiB of shared memory with 16-bit rows (quarter slots) and ~100 KiB with
  float32 rows (8-step slots): two per SM either way.
- Rows are read where they lie, in the caller's layout [B, Tp, H, D] viewed as
  [B * G, 4, chunk, H, D] (G groups of 4 chunks: a free reshape; a copy only when the chunk
  count is not a multiple of 4), each TMA box [4, slot, 16] of one head, as the forward
  walk reads them; states as [BH, NC, Vp, Kp] boxes [4, 16, 16].
- Each step's sums over the tile (dq, dk over its V-rows; dv, dbeta over its K-columns; the
  dL/dI sum over both) are reduce-scatters across the warp's lanes
  (`mosaic_tiles.sum_stores`), each lane storing its own outputs into the staging slot.
- The per-tile sums (dq, dk over V-tiles; dv, dbeta over K-slices; s over both) leave
  either as partial sums for XLA to add (deterministic) or, with `accumulate`, by TMA
  reduce-add into one zeroed array each (the order of the additions varies run to run);
  a sum that one tile alone writes (dv and dbeta where K is one slice, as at MQAR's K=16;
  dq and dk where V is one tile) is stored by a plain TMA copy, with nothing to zero.
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
    smem_bytes_of, sum_stores)

f32 = jnp.float32
SLOTS = 2  # Slots of the row ring.
# Checkpoint spacing: 8 steps (two sub-chunks of 4) is the widest that still fits two CTAs
# per SM with 16-bit rows; wider spacing re-advances more steps than occupancy repays.
EVERY = 8
SUB = 4  # Steps per sub-chunk (the states recomputed together in registers).
HOPPER_ONLY = False  # Hopper and newer.
# The most shared memory a CTA may take for two to share an SM (228 KiB per SM, 1 KiB of
# it reserved per CTA); the walk's registers (about 200 a thread) allow two as well.
TWO_PER_SM = 113 * 1024


def checkpoint_every(chunk: int) -> int:
  """Steps between checkpoints: EVERY, or a quarter chunk where that is shorter."""
  return min(EVERY, chunk // 4)


def _smem_scratch(chunk: int, sub: int, every: int, row_dtypes, slot: int) -> list:
  """The kernel's shared memory, in `_kernel`'s order: a ring slot pair [2, 4, slot, 16]
  per row input (row_dtypes: k, q, v, beta, dO[, dvar]) and for the gates; the prior
  precision row; the checkpoints of M and Ibar; two staging slots each for dq, dk, dv,
  dbeta; the per-step sums."""
  smem, ring = plgpu.SMEM, (SLOTS, WALKS, slot, TILE)
  checkpoints = (chunk // every, WALKS, TILE, TILE)
  return ([smem(ring, d) for d in row_dtypes]
          + [smem(ring, f32), smem((WALKS, TILE), f32), smem(checkpoints, f32),
             smem(checkpoints, f32)]
          + [smem((2, WALKS, sub, TILE), f32)] * 4 + [smem((WALKS, chunk), f32)])


def slot_steps(chunk: int, sub: int, row_dtypes, every: int) -> int:
  """Steps per ring slot: a quarter chunk, or one checkpoint segment (`every` steps) where
  only that smaller ring lets two CTAs share an SM (float32 rows in chunks of 64: 100
  KiB instead of 124). More slots mean more barrier waits and row fetches, so the
  quarter stays wherever it fits as well."""
  quarter = chunk // 4
  fits = lambda slot: smem_bytes_of(
      _smem_scratch(chunk, sub, every, row_dtypes, slot)) <= TWO_PER_SM
  return every if every < quarter and fits(every) and not fits(quarter) else quarter


def smem_bytes(chunk: int, sub: int, row_dtypes, every: int | None = None) -> int:
  """Shared memory of one CTA (row_dtypes as in `_smem_scratch`)."""
  every = every or checkpoint_every(chunk)
  slot = slot_steps(chunk, sub, row_dtypes, every)
  return smem_bytes_of(_smem_scratch(chunk, sub, every, row_dtypes, slot))


def supported(chunk: int, sub: int, row_dtypes, *, interpret: bool,
              every: int | None = None) -> bool:
  """Whether the chunk cuts into quarters of whole checkpoint segments of whole
  sub-chunks and, compiled, the CTA fits in shared memory."""
  quarter, every = chunk // 4, every or checkpoint_every(chunk)
  return (chunk % 4 == 0 and every > 0 and every % sub == 0 and quarter % every == 0
          and (interpret or smem_bytes(chunk, sub, row_dtypes, every) <= SMEM_LIMIT))


def supports(call: StageCall) -> str | None:
  """None where the kernel takes the call's chunk and rows (q, k, v, beta, dO and, with the
  variance, its float32 cotangent) in sub-chunks of SUB steps (`supported`) on the call's
  device (Hopper and newer), else why not."""
  rows = [call.q_dtype, call.k_dtype, call.v_dtype, call.beta_dtype, call.v_dtype]
  if call.with_var:
    rows.append(jnp.float32)
  return mosaic_refusal(supported(call.chunk, SUB, rows, interpret=call.interpret), call,
                        hopper_only=HOPPER_ONLY)


@dataclasses.dataclass(frozen=True)
class WalkBackwardMosaicTiles:
  """Sub-chunks of sub steps (its other tiles are fixed: [16, 16] per warp, checkpoints every
  `checkpoint_every` steps), over all of K padded to a multiple of 16."""

  backend: ClassVar[str] = "mosaic"
  sub: int

  def k_width(self, kp: int) -> int:
    """K width of the walk, for K padded to kp (a multiple of its 16-column tiles)."""
    return kp

  def starts_k_width(self, kp: int, kb: int) -> int:
    """K width to give the walk the boundary states at (of width kb >= kp): its own."""
    del kb
    return kp


def tiles(call: StageCall) -> WalkBackwardMosaicTiles:
  del call
  return WalkBackwardMosaicTiles(sub=SUB)


def temp_bytes(cfg: GpuKernelConfig) -> int:
  """Bytes of partial sums (one part with reduce-add) and broadcast gates per batch*head of
  one call (the walk has no scratch in global memory)."""
  tp, vp, kp = cfg.t + cfg.t_pad, cfg.v + cfg.v_pad, cfg.k_bwd
  pv, pk = (1, 1) if cfg.accumulate_bwd else (vp // TILE, kp // TILE)
  return 4 * tp * (pv * kp * 2 + pk * vp * 2 + pk * pv + TILE)


def _kernel(*refs, chunk, sub, every, slot_len, num_k, heads, groups, first, with_var,
            accumulate, added, interpret):
  """One CTA: 4 chunks (one per warp) of one batch*head, V-tile and K-slice.

  refs: the inputs (k, q, v, beta, dO[, dvar] as [B*G, 4, chunk, H, D], read at batch*head
  first + n; gates [BH, G, 4, chunk, 16]; ip [BH, NK, 4, 16]; start states
  [BH, G*4, Vp, Kp], all three from batch*head n of this call's range), the sums
  (dq, dk, dv, dbeta, s: one part each with `accumulate`, else one per tile), the
  adjoints, then the scratch of `_smem_scratch` and the ring and start barriers. The sums
  numbered in `added` (0-4: dq, dk, dv, dbeta, s) are zeroed inputs the CTAs add into;
  they come right after the inputs, the other sums and the adjoints after them.
  """
  n_rows = 6 if with_var else 5
  n_in = n_rows + 4
  ins, scratch = refs[:n_in], refs[n_in + 7:]
  row_g, (a_g, ip_g, m0_g, b0_g) = ins[:n_rows], ins[n_rows:]
  summed, stored = iter(refs[n_in:n_in + len(added)]), iter(refs[n_in + len(added):n_in + 7])
  dq_g, dk_g, dv_g, dbeta_g, s_g = (next(summed if i in added else stored) for i in range(5))
  am_g, ab_g = stored
  ring = scratch[:n_rows + 1]  # Rows, then gates: [SLOTS, 4, slot_len, 16] each.
  (ip_s, ckpt_m, ckpt_b, dq_o, dk_o, dv_o, dbeta_o, s_o, ring_bars,
   start_bar) = scratch[n_rows + 1:]
  fma, reciprocal = pointwise_ops(interpret)
  (sum_v, sum_v_of_products, sum_v_dk, sum_k_of_products,
   sum_all) = sum_stores(interpret)
  n_slots, segs_per_slot, subs_per_seg = chunk // slot_len, slot_len // every, every // sub

  p, g, n = (jax.lax.axis_index(name) for name in ("p", "g", "n"))
  vt, ks = p // num_k, p % num_k
  bg, h = ((first + n) // heads) * groups + g, (first + n) % heads  # The rows' block.
  kcols, vcols = pl.ds(ks * TILE, TILE), pl.ds(vt * TILE, TILE)
  walks = pl.ds(g * WALKS, WALKS)
  # Partial sums go to this tile's part; accumulated ones are all added into part 0.
  part_v, part_k = (0, 0) if accumulate else (vt, ks)
  def sum_out(i, src, dst, **kwargs):  # Sum i (0-4: dq, dk, dv, dbeta, s) to global memory.
    plgpu.copy_smem_to_gmem(src, dst, reduction_op="add" if i in added else None, **kwargs)
  plgpu.copy_gmem_to_smem(ip_g.at[n, ks], ip_s, start_bar)
  plgpu.copy_gmem_to_smem(m0_g.at[n, walks, vcols, kcols], ckpt_m.at[0], start_bar)
  plgpu.copy_gmem_to_smem(b0_g.at[n, walks, vcols, kcols], ckpt_b.at[0], start_bar)
  cols = [kcols, kcols] + [vcols] * (n_rows - 2)

  def fetch(i):  # The rows of the chunk's slot i into ring slot i % 2.
    slot, steps = i % SLOTS, pl.ds(i * slot_len, slot_len)
    for src, dst, c in zip(row_g, ring, cols):
      plgpu.copy_gmem_to_smem(src.at[bg, :, steps, h, c], dst.at[slot], ring_bars.at[slot])
    plgpu.copy_gmem_to_smem(a_g.at[n, g, :, steps], ring[-1].at[slot], ring_bars.at[slot])

  fetch(0)
  fetch(1)

  def row(i, slot, lt, layout):
    return plgpu.load(ring[i].at[slot, :, lt, :], layout=layout).astype(f32)

  def write_rows(slot, lt):  # What the state update at local step lt needs.
    return (over_k(row(0, slot, lt, K_ROWS)), over_v(row(2, slot, lt, V_ROWS)),
            over_v(row(3, slot, lt, V_ROWS)), over_v(row(n_rows, slot, lt, V_ROWS)))

  def advance(m, b, rows):
    k, v, beta, a = rows
    return fma(a, m, v * k), fma(a, b, beta * (k * k))

  plgpu.barrier_wait(start_bar)
  m = plgpu.load(ckpt_m.at[0], layout=TILE_PER_WARP)
  b = plgpu.load(ckpt_b.at[0], layout=TILE_PER_WARP)
  ip = over_k(plgpu.load(ip_s, layout=K_ROWS))

  def forward_slot(i, carry):  # The checkpoint pass over the chunk's slot i.
    slot = i % SLOTS
    plgpu.barrier_wait(ring_bars.at[slot])

    def checkpoints(sg, carry):
      m, b = carry
      c = i * segs_per_slot + sg

      @pl.when(c > 0)  # Checkpoint 0 is the start state, already in place.
      def _():
        ckpt_m[c] = m
        ckpt_b[c] = b
      for s in range(every):
        m, b = advance(m, b, write_rows(slot, sg * every + s))
      return m, b

    # The chunk's last segment leads to no checkpoint: the pass stops at its start (an
    # eighth of the pass's steps in chunks of 64), and the reverse pass re-advances from it.
    last = (i == n_slots - 1).astype(jnp.int32)
    carry = jax.lax.fori_loop(0, segs_per_slot - last, checkpoints, carry)

    @pl.when(i + SLOTS < n_slots)
    def _():
      plgpu.commit_smem()  # Every warp is done with the slot before it is refilled.
      fetch(i + SLOTS)
    return carry

  m, b = jax.lax.fori_loop(0, n_slots, forward_slot, (m, b))
  ckpt_m[chunk // every - 1] = m
  ckpt_b[chunk // every - 1] = b

  def reverse_sub_chunk(carry, slot, lt0, c, lead, out_slot, t0):
    """The sub-chunk at local steps lt0.. (chunk steps t0..) of checkpoint segment c,
    whose first `lead` steps are re-advanced from the checkpoint.
    carry: gm, gb, the adjoints of the step after the sub-chunk (not yet decayed by its
    gate a_next), and a_next."""
    gm, gb, a_next = carry
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # out_slot's copies of 2 sub-chunks ago.
    m = plgpu.load(ckpt_m.at[c], layout=TILE_PER_WARP)
    b = plgpu.load(ckpt_b.at[c], layout=TILE_PER_WARP)
    m, b = jax.lax.fori_loop(
        0, lead, lambda s, mb: advance(*mb, write_rows(slot, lt0 - lead + s)), (m, b))
    rows, states = [], []
    for s in range(sub):  # Recompute the sub-chunk's states, kept in registers.
      rows.append(write_rows(slot, lt0 + s))
      m, b = advance(m, b, rows[-1])
      states.append((m, b))
    for s in reversed(range(sub)):
      lt = lt0 + s
      k, v, beta, a = rows[s]
      m, b = states[s]
      q = over_k(row(1, slot, lt, K_ROWS))
      do = over_v(row(4, slot, lt, V_ROWS))
      # out = sum_k mu q with mu = m r, r = 1 / (b + Ip): dL/dm = do q r and
      # dL/db = -(do q r) mu (+ the variance's -dvar (q r)^2).
      r = reciprocal(b + ip)
      mu = m * r
      dm = (do * q) * r
      di = -(dm * mu)
      if with_var:
        dvar = over_v(row(5, slot, lt, V_ROWS))
        qr = q * r
        sum_v(fma(2.0 * dvar, qr, do * mu), dq_o.at[out_slot, :, s])
        di = fma(-dvar, qr * qr, di)
      else:
        sum_v_of_products(do, mu, dq_o.at[out_slot, :, s])
      gm = fma(a_next, gm, dm)
      gb = fma(a_next, gb, di)
      sum_v_dk(gm, v, gb, beta, k, dk_o.at[out_slot, :, s])
      sum_k_of_products(gm, k, dv_o.at[out_slot, :, s])
      sum_k_of_products(gb, k * k, dbeta_o.at[out_slot, :, s])
      sum_all(di, s_o.at[:, t0 + s])
      a_next = a
    plgpu.commit_smem()
    steps = pl.ds(t0, sub)
    sum_out(0, dq_o.at[out_slot], dq_g.at[part_v, n, g, :, steps, kcols], commit_group=False)
    sum_out(1, dk_o.at[out_slot], dk_g.at[part_v, n, g, :, steps, kcols], commit_group=False)
    sum_out(2, dv_o.at[out_slot], dv_g.at[part_k, n, g, :, steps, vcols], commit_group=False)
    sum_out(3, dbeta_o.at[out_slot], dbeta_g.at[part_k, n, g, :, steps, vcols])
    return gm, gb, a_next

  def reverse_slot(done, carry):  # The chunk's slots, last first.
    si = n_slots - 1 - done
    slot = si % SLOTS

    @pl.when(si < n_slots - SLOTS)  # The last two are still resident from the checkpoint pass.
    def _():
      plgpu.barrier_wait(ring_bars.at[slot])

    def segment(j, carry):
      sg = segs_per_slot - 1 - j
      c = si * segs_per_slot + sg
      # The segment's sub-chunks, last first, as a loop: one copy of the reverse body (the
      # lead re-advance is a loop too) keeps instruction fetch off the walk's stalls.
      def sub_chunk(i, carry):
        h = subs_per_seg - 1 - i
        lt0 = sg * every + h * sub
        out_slot = (c * subs_per_seg + h) % 2  # Alternates between consecutive sub-chunks.
        return reverse_sub_chunk(carry, slot, lt0, c, h * sub, out_slot,
                                 si * slot_len + lt0)

      return jax.lax.fori_loop(0, subs_per_seg, sub_chunk, carry)

    carry = jax.lax.fori_loop(0, segs_per_slot, segment, carry)

    @pl.when(si >= SLOTS)
    def _():
      plgpu.commit_smem()
      fetch(si - SLOTS)
    return carry

  zero = plgpu.layout_cast(jnp.zeros((WALKS, TILE, TILE), f32), TILE_PER_WARP)
  gm, gb, a_first = jax.lax.fori_loop(0, n_slots, reverse_slot, (zero, zero, zero))
  ckpt_m[0] = a_first * gm  # Checkpoint 0's buffers now hold the adjoints.
  ckpt_b[0] = a_first * gb
  plgpu.commit_smem()
  sum_out(4, s_o, s_g.at[part_k, part_v, n, g], commit_group=False)
  plgpu.copy_smem_to_gmem(ckpt_m.at[0], am_g.at[n, walks, vcols, kcols], commit_group=False)
  plgpu.copy_smem_to_gmem(ckpt_b.at[0], ab_g.at[n, walks, vcols, kcols])
  plgpu.wait_smem_to_gmem(0)


def walk_backward(q, k, v, beta, a, ip_row, do, dvar, m_starts, b_starts, *, heads: int,
                  chunk: int, sub: int, interpret: bool,
                  bh_range: tuple[int, int] | None = None, accumulate: bool = False,
                  every: int | None = None):
  """Reverse walk over all chunks, each with zero adjoint from later chunks.

  Args:
    q, k: [B, Tp, H, Kp]; v, beta, do: [B, Tp, H, Vp]; dvar: [B, Tp, H, Vp] or None (the
    caller's layout, padded); a: [BH, Tp] step gates; ip_row: [BH, Kp]; m_starts,
    b_starts: [BH, NC, Vp, Ks] with Ks >= Kp (columns past Kp are not read).
    Kp and Vp are multiples of 16, Tp of chunk; `supported(chunk, sub, ...)` holds.
    heads: H (batch*head n is batch n // H, head n % H).
    bh_range: (first, count): walk only these batch*heads.
    accumulate: add the tiles' sums by TMA reduce-add into one part (compiled only:
      interpret mode has no reduce-add); else one partial sum per tile.
    every: steps between checkpoints (default `checkpoint_every(chunk)`).

  Returns:
    As `walk_backward_triton.walk_backward` with groups = Vp / 16 and k_split = Kp / 16: dq, dk
    [P, BH, Tp, Kp] (P = Vp / 16 parts); dv, dbeta [P, BH, Tp, Vp] (P = Kp / 16);
    s [Kp/16, Vp/16, BH, Tp]; adj_m, adj_b [BH, NC, Vp, Kp]. With `accumulate`, P = 1
    and s is [1, 1, BH, Tp].
  """
  if accumulate and interpret:
    raise ValueError("accumulate=True needs the compiled kernel (interpret mode has no "
                     "TMA reduce-add)")
  every = every or checkpoint_every(chunk)
  first, count = bh_range or (0, a.shape[0])
  pick = lambda x: jax.lax.slice_in_dim(x, first, first + count)
  bh, (b, tp, _, kp), vp = count, q.shape, v.shape[-1]
  nc = tp // chunk
  groups = -(-nc // WALKS)
  nk, nv = kp // TILE, vp // TILE
  t_all = groups * WALKS * chunk
  with_var = dvar is not None
  row_inputs = [k, q, v, beta, do] + ([dvar] if with_var else [])
  row_dtypes = [x.dtype for x in row_inputs]
  if not supported(chunk, sub, row_dtypes, interpret=interpret, every=every):
    raise ValueError(f"chunk={chunk}, sub={sub}, every={every} with rows of "
                     f"{[jnp.dtype(d).name for d in row_dtypes]} do not fit the kernel")

  def rows(x):  # [B, Tp, H, D] -> [B*G, 4, chunk, H, D] (a copy only where Tp pads).
    if t_all != tp:
      x = jnp.pad(x, ((0, 0), (0, t_all - tp), (0, 0), (0, 0)))
    return x.reshape(b * groups, WALKS, chunk, heads, x.shape[-1])

  def gate_rows(x):  # [BH, Tp, 16] -> [count, G, 4, chunk, 16].
    x = pick(x)
    if t_all != tp:
      x = jnp.pad(x, ((0, 0), (0, t_all - tp), (0, 0)))
    return x.reshape(count, groups, WALKS, chunk, TILE)

  def states(x):  # [BH, NC, Vp, Kp] -> [count, G*4, Vp, Kp].
    x = pick(x)
    if groups * WALKS != nc:
      x = jnp.pad(x, ((0, 0), (0, groups * WALKS - nc), (0, 0), (0, 0)))
    return x

  gates = jnp.broadcast_to(a.astype(f32)[..., None], a.shape + (TILE,))
  ins = [rows(x) for x in row_inputs] + [
      gate_rows(gates),
      jnp.broadcast_to(pick(ip_row).reshape(bh, nk, 1, TILE), (bh, nk, WALKS, TILE)),
      states(m_starts), states(b_starts)]
  pv, pk = (1, 1) if accumulate else (nv, nk)
  # With `accumulate`, the sums that several tiles write are added into zeroed arrays.
  added = tuple(i for i, tiles in enumerate((nv, nv, nk, nk, nv * nk))
                if accumulate and tiles > 1)
  sds = jax.ShapeDtypeStruct
  sum_types = ([sds((pv, bh, groups, WALKS, chunk, kp), f32)] * 2
               + [sds((pk, bh, groups, WALKS, chunk, vp), f32)] * 2
               + [sds((pk, pv, bh, groups, WALKS, chunk), f32)])
  adjoint_types = [sds((bh, groups * WALKS, vp, kp), f32)] * 2
  slot_len = slot_steps(chunk, sub, row_dtypes, every)
  scratch = _smem_scratch(chunk, sub, every, row_dtypes, slot_len) + [
      plgpu.Barrier(num_arrivals=len(row_inputs) + 1, num_barriers=SLOTS),
      plgpu.Barrier(num_arrivals=3)]
  # No automatic barriers: every thread reads back only what it wrote itself, or what a TMA
  # copy brought in after a barrier; stores leave through commit_smem.
  kernel = mosaic_kernel(
      functools.partial(_kernel, chunk=chunk, sub=sub, every=every, slot_len=slot_len,
                        num_k=nk, heads=heads, groups=groups, first=first,
                        with_var=with_var, accumulate=accumulate, added=added,
                        interpret=interpret),
      out_type=[t for i, t in enumerate(sum_types) if i not in added] + adjoint_types,
      scratch_types=scratch, grid=(nv * nk, groups, bh), grid_names=("p", "g", "n"),
      interpret=interpret, name="palimpsa_walk_backward_mosaic")
  # Zeroed sums the kernel adds into (aliased in and out).
  refs = [jax.new_ref(jnp.zeros(sum_types[i].shape, f32)) for i in added]
  outs = iter(kernel(*ins, *refs))
  summed = iter([jax.freeze(r) for r in refs])
  dq, dk, dv, dbeta, s = (next(summed if i in added else outs) for i in range(5))
  adj_m, adj_b = outs
  back = lambda x: x.reshape(x.shape[0], bh, t_all, x.shape[-1])[:, :, :tp]
  return (back(dq), back(dk), back(dv), back(dbeta),
          s.reshape(pk, pv, bh, t_all)[..., :tp], adj_m[:, :nc], adj_b[:, :nc])


def launch(cfg: GpuKernelConfig, q, k, v, beta, a, ip_row, do, dvar, m_starts, b_starts, *,
           bh_range: tuple[int, int] | None = None):
  """`walk_backward` for cfg's call, adding its sums by reduce-add where cfg says so
  (arguments as there)."""
  return walk_backward(q, k, v, beta, a, ip_row, do, dvar, m_starts, b_starts, heads=cfg.h,
                       chunk=cfg.chunk, sub=cfg.walk_bwd.sub, interpret=cfg.interpret,
                       bh_range=bh_range, accumulate=cfg.accumulate_bwd)
