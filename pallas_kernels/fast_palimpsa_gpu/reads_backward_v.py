"""The V-side kernel of the reads' backward (reads_backward.py): what needs the V-indexed rows.

One CTA (a warpgroup) per (batch*head, group of chunks), over all of V in sub-tiles of
`sub` columns whose rows (v, beta, dout, N and the variance's cotangent) come by TMA
through a ring of `slots` slots. It recomputes the forward's V-independent part (D, ibk,
qk, ibs, W) and per sub-tile Av, ibv, own and the carried read Rc, then writes dv, dbeta
(the reads' share), dZ (bfloat16, for the K-side kernel), dbv and the per-step rows of
`VROW_*`. Nothing but per-step rows is carried from one sub-tile to the next: dD's
V-side part enters only through row sums (reads_backward.py), and dbv's sums over each
chunk's steps are a wgmma.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fast_palimpsa_gpu.reads_forward import (COL, ROW, WGMMA, carried_read,
                                                            decay_matrix, matmul,
                                                            per_chunk_rows)
from pallas_kernels.fast_palimpsa_gpu.tiles import (MIN_ROWS, ROW_CS, ROW_F, ROW_IP, ROW_MB,
                                                    NUM_ROWS, BackwardTiles, tiled)
from pallas_kernels.palimpsa_gpu.launch_mosaic import mosaic_kernel
from pallas_kernels.palimpsa_gpu.mosaic_tiles import smem_bytes_of

f32, bf16 = jnp.float32, jnp.bfloat16

# The per-step rows the kernel writes, [BH, NB, NUM_VROWS, R] float32: dg's two halves
# from dD's V-side part, the cotangents of f, cs and Ip, and what the K-side kernel needs:
# dsigma, dibs and dmk.
(VROW_G_ROWS, VROW_G_COLS, VROW_F, VROW_CS, VROW_IP, VROW_SIGMA, VROW_IBS,
 VROW_MK) = range(8)
NUM_VROWS = 8


def chunk_sums_selector(rows_s, r: int, chunk: int):
  """[64, R] float32 (WGMMA): row c holds f_t on the steps t of chunk c, else 0; so
  selector @ X [R, N] holds in row c the f-weighted sum of X over chunk c's steps."""
  f = plgpu.load(rows_s.at[ROW_F], layout=COL)
  i = plgpu.broadcasted_iota(jnp.int32, (MIN_ROWS, r), 0, layout=WGMMA)
  t = plgpu.broadcasted_iota(jnp.int32, (MIN_ROWS, r), 1, layout=WGMMA)
  return jnp.where(t // chunk == i, jax.lax.broadcast_in_dim(f, (MIN_ROWS, r), (1,)), 0.0)


@dataclasses.dataclass(frozen=True)
class _Smem:
  """The kernel's shared memory by name (`_scratch`)."""

  qk: object  # [R, Kp] q, then q / ibk
  k: object
  x: object  # mb k^2
  d: object  # [R, R] D
  w: object  # [R, R] W
  sel: object  # [64, R] chunk_sums_selector
  rows: object  # [NUM_ROWS, R]
  bk: object  # [G, k_span]
  bv: object  # [G, span]
  drows: object  # [NUM_VROWS, R] staging
  ring: dict  # v, beta, dout [slots, R, sub]; n [slots, G, sub, Kp]; dvar (variance)
  stage: dict  # y, dz, dav (wgmma operands), dv, dbeta [R, sub]; dbv [64, sub] (copies out)


def _scratch(t: BackwardTiles, kp: int, vp: int, with_var: bool):
  """(scratch types, a function of the kernel's scratch refs -> (_Smem, barriers))."""
  smem, r, g, sub, slots = plgpu.SMEM, t.rows, t.groups, t.sub, t.slots
  ops = tiled(bf16, kp, r, sub, vp)  # One swizzle for every wgmma operand (A and B share it).
  rk = lambda: smem((r, kp), bf16, transforms=ops)
  rv = lambda *n: smem((*n, r, sub), bf16, transforms=ops)
  ring = dict(v=rv(slots), beta=rv(slots), dout=rv(slots),
              n=smem((slots, g, sub, kp), bf16, transforms=ops))
  if with_var:
    ring["dvar"] = smem((slots, r, sub), f32, transforms=tiled(f32, sub, vp))
  stage = {name: rv() for name in ("y", "dz", "dav", "dv", "dbeta")}
  stage["dbv"] = smem((MIN_ROWS, sub), f32)  # Rows [0, G) copied out.
  fixed = dict(qk=rk(), k=rk(), x=rk(), d=smem((r, r), bf16, transforms=ops),
               w=smem((r, r), bf16, transforms=ops),
               sel=smem((MIN_ROWS, r), bf16, transforms=ops), rows=smem((NUM_ROWS, r), f32),
               bk=smem((g, t.k_span(kp)), f32), bv=smem((g, t.v_span(vp)), f32),
               drows=smem((NUM_VROWS, r), f32))
  scratch = list(fixed.values()) + [
      ring, stage, plgpu.Barrier(num_arrivals=5),
      plgpu.Barrier(num_arrivals=3 + g + int(with_var), num_barriers=slots)]

  def unpack(refs):
    named = dict(zip(fixed, refs[:len(fixed)]))
    ring_refs, stage_refs, setup_bar, ring_bars = refs[len(fixed):]
    return _Smem(**named, ring=ring_refs, stage=stage_refs), setup_bar, ring_bars

  return scratch, unpack


def smem_bytes(t: BackwardTiles, kp: int, vp: int, with_var: bool) -> int:
  scratch, _ = _scratch(t, kp, vp, with_var)
  return smem_bytes_of(jax.tree.leaves(scratch[:-2]))


def _kernel(*refs, heads, chunk, k_true, with_var, num_sub, t: BackwardTiles, unpack):
  """One CTA: the V-side backward of the reads of one (batch*head n, group of chunks).

  refs: q, k [B, Tp, H, Kp]; v, beta, dout [B, Tp, H, Vp]; dvar [B, Tp, H, Vp] (with the
  variance); rows [BH, NB, NUM_ROWS, R]; bk [BH, NC, k_span]; bv [BH, NC, span]; n [BH, NC, Vp,
  Kp]; then the outputs dv, dbeta, dz [B, Tp, H, Vp] (bfloat16), vrows [BH, NB, NUM_VROWS,
  R], dbv [BH, NC, span] (float32); then the scratch of `_scratch`.
  """
  n_in = 10 if with_var else 9
  ins, outs, scratch = refs[:n_in], refs[n_in:n_in + 5], refs[n_in + 5:]
  if with_var:
    q_g, k_g, v_g, beta_g, dout_g, dvar_g, rows_g, bk_g, bv_g, n_g = ins
  else:
    (q_g, k_g, v_g, beta_g, dout_g, rows_g, bk_g, bv_g, n_g), dvar_g = ins, None
  dv_g, dbeta_g, dz_g, vrows_g, dbv_g = outs
  s, setup_bar, ring_bars = unpack(scratch)
  ring, stage = s.ring, s.stage
  r, g, sub, slots = t.rows, t.groups, t.sub, t.slots
  kp = s.k.shape[-1]
  blk, n = jax.lax.axis_index("b"), jax.lax.axis_index("n")
  batch, head = n // heads, n % heads
  steps, chunks = pl.ds(blk * r, r), pl.ds(blk * g, g)

  plgpu.copy_gmem_to_smem(q_g.at[batch, steps, head], s.qk, setup_bar)
  plgpu.copy_gmem_to_smem(k_g.at[batch, steps, head], s.k, setup_bar)
  plgpu.copy_gmem_to_smem(rows_g.at[n, blk], s.rows, setup_bar)
  plgpu.copy_gmem_to_smem(bk_g.at[n, chunks], s.bk, setup_bar)
  plgpu.copy_gmem_to_smem(bv_g.at[n, chunks], s.bv, setup_bar)

  def fetch(j):  # Sub-tile j's rows into slot j % slots.
    slot, bar, col = j % slots, ring_bars.at[j % slots], pl.ds(j * sub, sub)
    rows_of = lambda x_g: x_g.at[batch, steps, head, col]
    plgpu.copy_gmem_to_smem(rows_of(v_g), ring["v"].at[slot], bar)
    plgpu.copy_gmem_to_smem(rows_of(beta_g), ring["beta"].at[slot], bar)
    plgpu.copy_gmem_to_smem(rows_of(dout_g), ring["dout"].at[slot], bar)
    if with_var:
      plgpu.copy_gmem_to_smem(rows_of(dvar_g), ring["dvar"].at[slot], bar)
    for c in range(g):  # One chunk per copy: a TMA box has at most 5 dimensions.
      plgpu.copy_gmem_to_smem(n_g.at[n, blk * g + c, col], ring["n"].at[slot, c], bar)

  for j in range(min(slots, num_sub)):
    fetch(j)
  plgpu.barrier_wait(setup_bar)

  row = lambda i: plgpu.load(s.rows.at[i], layout=ROW)
  over_k = lambda x: jax.lax.broadcast_in_dim(x, (r, kp), (0,))
  over_v = lambda x: jax.lax.broadcast_in_dim(x, (r, sub), (0,))
  f, cs, ip = row(ROW_F), row(ROW_CS), row(ROW_IP)
  row_zeros = lambda: plgpu.layout_cast(jnp.zeros((r,), f32), ROW)

  # The forward's V-independent part (reads_forward.py), qk over q in shared memory.
  k = plgpu.load(s.k, layout=WGMMA).astype(f32)
  ksq = k * k
  s.x[...] = (ksq * over_k(row(ROW_MB))).astype(bf16)
  mk = jnp.sum(ksq, axis=1) * (1.0 / k_true)
  s.d[...] = decay_matrix(s.rows, r).astype(bf16)
  s.sel[...] = chunk_sums_selector(s.rows, r, chunk).astype(bf16)
  plgpu.commit_smem()
  ak = matmul(s.d, s.x, (r, kp))
  bk = per_chunk_rows(lambda c: plgpu.load(s.bk.at[c, pl.ds(0, kp)], layout=COL), r, chunk,
                      g, kp)
  ibk = over_k(f) * bk + ak + over_k(ip)
  q = plgpu.load(s.qk, layout=WGMMA).astype(f32)
  qk = q / ibk
  ibs = (jnp.sum(ibk, axis=1) - (kp - k_true) * ip) * (1.0 / k_true)
  sigma = jnp.sum(q * qk, axis=1) if with_var else None
  s.qk[...] = qk.astype(bf16)  # Each thread rewrites what it read: no barrier needed.
  plgpu.commit_smem()
  scores = matmul(s.qk, s.k.transpose((1, 0)), (r, r))
  s.w[...] = (scores * decay_matrix(s.rows, r)).astype(bf16)
  plgpu.commit_smem()

  # Per-step sums over the sub-tiles (dg's halves: reads_backward.py). The sub-tiles are
  # a loop, not unrolled: interleaving their code only raises register pressure.
  def sub_tile(j, sums):
    d_rows, d_cols, d_sigma, d_ibs, d_cs, d_f, d_ip, d_mk = sums
    slot, col = j % slots, pl.ds(j * sub, sub)
    plgpu.barrier_wait(ring_bars.at[slot])
    beta = plgpu.load(ring["beta"].at[slot], layout=WGMMA).astype(f32)
    stage["y"][...] = (beta * over_v(mk)).astype(bf16)
    plgpu.commit_smem()

    def reads(acc_v, acc_own):
      plgpu.wgmma(acc_v, s.d, stage["y"])
      plgpu.wgmma(acc_own, s.w, ring["v"].at[slot])
      return acc_v[...], acc_own[...]

    av, own = pl.run_scoped(reads, *[plgpu.ACC((r, sub), f32)] * 2)
    rc = carried_read(s.qk, ring["n"].at[slot], r, sub, chunk)
    bv = per_chunk_rows(lambda c: plgpu.load(s.bv.at[c, col], layout=COL), r, chunk, g, sub)
    ibv = over_v(f) * bv + av + over_v(ip)
    vs = over_v(ibs) / ibv
    dout = plgpu.load(ring["dout"].at[slot], layout=WGMMA).astype(f32)
    dz = dout * vs
    dvs = dout * (own + over_v(cs) * rc)
    if with_var:
      dvar = plgpu.load(ring["dvar"].at[slot], layout=WGMMA)
      dvs = dvs + dvar * over_v(sigma)
      d_sigma = d_sigma + jnp.sum(dvar * vs, axis=1)
    dibv = -dvs * vs / ibv
    d_ibs = d_ibs + jnp.sum(dvs / ibv, axis=1)
    d_cs = d_cs + jnp.sum(dz * rc, axis=1)
    d_f = d_f + jnp.sum(dibv * bv, axis=1)
    d_ip = d_ip + jnp.sum(dibv, axis=1)
    d_rows = d_rows + jnp.sum(dibv * av + dz * own, axis=1)
    # The copies out of the last sub-tile have read the staging buffers.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    stage["dz"][...] = dz.astype(bf16)
    stage["dav"][...] = dibv.astype(bf16)
    plgpu.commit_smem()

    def row_grads(acc_dv, acc_dy, acc_dbv):
      plgpu.wgmma(acc_dv, s.w.transpose((1, 0)), stage["dz"])
      plgpu.wgmma(acc_dy, s.d.transpose((1, 0)), stage["dav"])
      plgpu.wgmma(acc_dbv, s.sel, stage["dav"])
      return acc_dv[...], acc_dy[...], acc_dbv[...]

    dv, dy, dbv = pl.run_scoped(row_grads, plgpu.ACC((r, sub), f32), plgpu.ACC((r, sub), f32),
                                plgpu.ACC((MIN_ROWS, sub), f32))
    beta = plgpu.load(ring["beta"].at[slot], layout=WGMMA).astype(f32)
    v = plgpu.load(ring["v"].at[slot], layout=WGMMA).astype(f32)
    d_mk = d_mk + jnp.sum(dy * beta, axis=1)
    d_cols = d_cols + jnp.sum(dy * beta * over_v(mk) + dv * v, axis=1)
    stage["dv"][...] = dv.astype(bf16)
    stage["dbeta"][...] = (dy * over_v(mk)).astype(bf16)
    stage["dbv"][...] = dbv
    plgpu.commit_smem()  # Also: every thread is done with the slot, which may refill.
    plgpu.copy_smem_to_gmem(stage["dz"], dz_g.at[batch, steps, head, col], commit_group=False)
    plgpu.copy_smem_to_gmem(stage["dv"], dv_g.at[batch, steps, head, col], commit_group=False)
    plgpu.copy_smem_to_gmem(stage["dbeta"], dbeta_g.at[batch, steps, head, col],
                            commit_group=False)
    plgpu.copy_smem_to_gmem(stage["dbv"].at[pl.ds(0, g)], dbv_g.at[n, chunks, col],
                            commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    pl.when(j + slots < num_sub)(lambda: fetch(j + slots))
    return d_rows, d_cols, d_sigma, d_ibs, d_cs, d_f, d_ip, d_mk

  (d_rows, d_cols, d_sigma, d_ibs, d_cs, d_f, d_ip, d_mk) = jax.lax.fori_loop(
      0, num_sub, sub_tile, tuple(row_zeros() for _ in range(8)))
  vrows = {VROW_G_ROWS: d_rows, VROW_G_COLS: d_cols, VROW_F: d_f, VROW_CS: d_cs,
           VROW_IP: d_ip, VROW_IBS: d_ibs, VROW_MK: d_mk,
           VROW_SIGMA: d_sigma}
  for i, vec in vrows.items():
    s.drows[i] = vec
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(s.drows, vrows_g.at[n, blk])
  plgpu.wait_smem_to_gmem(0)


def backward_v(q, k, v, beta, rows, bk, bv, n_c, dout, dvar, *, heads: int, chunk: int,
               k_true: int, tiles: BackwardTiles, interpret):
  """The V-side kernel. Arguments as `reads_backward.chunk_reads_backward`'s (bk padded to
  `tiles.k_span(Kp)`, bv to `tiles.v_span(Vp)`).

  Returns dv, dbeta, dz [B, Tp, H, Vp] (v's dtype), vrows [BH, NB, NUM_VROWS, R] and dbv
  [BH, NC, span] float32.
  """
  vp = v.shape[-1]
  bh, nb = rows.shape[:2]
  with_var = dvar is not None
  scratch, unpack = _scratch(tiles, q.shape[-1], vp, with_var)
  sds = jax.ShapeDtypeStruct
  out_type = [sds(v.shape, v.dtype), sds(beta.shape, beta.dtype), sds(v.shape, v.dtype),
              sds((bh, nb, NUM_VROWS, tiles.rows), f32), sds(bv.shape, f32)]
  # No automatic barriers: rows arrive by TMA before their barrier waits; what threads
  # store for the tensor cores or a copy out is made visible by commit_smem first; the
  # staging buffers are rewritten only after the last copies out have read them; a ring
  # slot is refilled after the commit_smem that follows its last reads.
  kernel = mosaic_kernel(
      functools.partial(_kernel, heads=heads, chunk=chunk, k_true=k_true, with_var=with_var,
                        num_sub=tiles.num_sub(vp), t=tiles, unpack=unpack),
      out_type=out_type, scratch_types=scratch, grid=(nb, bh), grid_names=("b", "n"),
      interpret=interpret, name="fast_palimpsa_reads_backward_v")
  ins = (q, k, v, beta, dout) + ((dvar,) if with_var else ()) + (rows, bk, bv, n_c)
  return tuple(kernel(*ins))
