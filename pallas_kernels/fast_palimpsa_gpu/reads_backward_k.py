"""The K-side kernel of the reads' backward (reads_backward.py): what needs the K-indexed rows.

One CTA (a warpgroup) per (batch*head, group of chunks, block of `k_sub` K columns): every
product it takes is indexed by its K columns or sums over them, so the K-blocks are
independent. From the V-side kernel's dZ [R, V] and per-step rows (dsigma, dibs, dmk) it
recomputes dS = (dZ @ v^T) D, and ibk and qk on its columns, and writes dq, dk, dN (per
chunk, in pieces of 64 V rows), dbk, and the per-step rows of `KROW_*` (summed over the
K-blocks by the caller). Every accumulator is [R, k_sub], [R, R] or [64, k_sub], and
every sum over steps a wgmma (`reads_backward_v.chunk_sums_selector`).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fast_palimpsa_gpu.reads_backward_v import (NUM_VROWS, VROW_IBS, VROW_MK,
                                                               VROW_SIGMA,
                                                               chunk_sums_selector)
from pallas_kernels.fast_palimpsa_gpu.reads_forward import (COL, ROW, WGMMA, chunk_mask,
                                                            decay_matrix, matmul,
                                                            per_chunk_rows)
from pallas_kernels.fast_palimpsa_gpu.tiles import (MIN_ROWS, ROW_CS, ROW_F, ROW_IP, ROW_MB,
                                                    NUM_ROWS, V_PIECE, BackwardTiles, tiled,
                                                    v_pieces)
from pallas_kernels.palimpsa_gpu.launch_mosaic import mosaic_kernel
from pallas_kernels.palimpsa_gpu.mosaic_tiles import smem_bytes_of

f32, bf16 = jnp.float32, jnp.bfloat16

# The per-step rows the kernel writes, [BH, NB, K-blocks, NUM_KROWS, R] float32: dg's two
# halves from dD's K-side part and the cotangents of f, Ip and mb, each over the CTA's K
# columns.
KROW_G_ROWS, KROW_G_COLS, KROW_F, KROW_IP, KROW_MB = range(5)
NUM_KROWS = 5


@dataclasses.dataclass(frozen=True)
class _Smem:
  """The kernel's shared memory by name (`_scratch`)."""

  q: object  # [R, k_sub] q, then qk = q / ibk
  k: object
  x: object  # mb k^2
  dak: object  # dAk = dibk
  qkc: object  # [G, R, k_sub] cs qk on the rows of chunk c
  d: object  # [R, R] D
  ds: object  # [R, R] dS
  sel: object  # [64, R] chunk_sums_selector
  dz: object  # [pieces, R, 64] dZ (tiles.v_pieces)
  v: object  # [pieces, R, 64] v
  n: object  # [G, pieces, 64, k_sub] N of each chunk
  rows: object  # [NUM_ROWS, R]
  vrows: object  # [NUM_VROWS, R]
  bk: object  # [G, k_span]: all of bk's columns (BackwardTiles.k_span)
  dq: object  # [R, k_sub] staging
  dk: object
  dn: object  # [64, k_sub] float32 staging
  krows: object  # [NUM_KROWS, R] staging
  dbk: object  # [64, k_sub] staging: rows [0, G)


def _scratch(t: BackwardTiles, kp: int, vp: int):
  """(scratch types, a function of the kernel's scratch refs -> (_Smem, barrier))."""
  smem, r, g, ks = plgpu.SMEM, t.rows, t.groups, t.k_sub
  pieces = len(v_pieces(vp))
  ops = tiled(bf16, ks, r, V_PIECE, kp, vp)  # One swizzle for every wgmma operand.
  rk = lambda *n: smem((*n, r, ks), bf16, transforms=ops)
  named = dict(q=rk(), k=rk(), x=rk(), dak=rk(), qkc=rk(g),
               d=smem((r, r), bf16, transforms=ops), ds=smem((r, r), bf16, transforms=ops),
               sel=smem((MIN_ROWS, r), bf16, transforms=ops),
               dz=smem((pieces, r, V_PIECE), bf16, transforms=ops),
               v=smem((pieces, r, V_PIECE), bf16, transforms=ops),
               n=smem((g, pieces, V_PIECE, ks), bf16, transforms=ops),
               rows=smem((NUM_ROWS, r), f32), vrows=smem((NUM_VROWS, r), f32),
               bk=smem((g, t.k_span(kp)), f32), dq=rk(), dk=rk(),
               dn=smem((V_PIECE, ks), f32, transforms=tiled(f32, ks, kp)),  # Kp: its copy out.
               krows=smem((NUM_KROWS, r), f32), dbk=smem((MIN_ROWS, ks), f32))
  barrier = plgpu.Barrier(num_arrivals=5 + pieces * (2 + g))

  def unpack(refs):
    return _Smem(**dict(zip(named, refs[:-1]))), refs[-1]

  return list(named.values()) + [barrier], unpack


def smem_bytes(t: BackwardTiles, kp: int, vp: int) -> int:
  return smem_bytes_of(_scratch(t, kp, vp)[0][:-1])


def _kernel(q_g, k_g, v_g, rows_g, bk_g, dz_g, vrows_g, n_g, dq_g, dk_g, krows_g, dbk_g,
            dn_g, *scratch, heads, chunk, k_true, with_var, t: BackwardTiles, unpack):
  """One CTA: the K-side backward of one (batch*head n, group of chunks, K-block).

  q_g, k_g [B, Tp, H, Kp]; v_g, dz_g [B, Tp, H, Vp]; rows_g [BH, NB, NUM_ROWS, R]; bk_g
  [BH, NC, k_span]; vrows_g [BH, NB, NUM_VROWS, R]; n_g [BH, NC, Vp, Kp]; then the
  outputs dq, dk [B, Tp, H, Kp], krows [BH, NB, K-blocks, NUM_KROWS, R], dbk [BH, NC,
  k_span], dn [BH, NC, Vp, Kp]; then the scratch of `_scratch`.
  """
  s, bar = unpack(scratch)
  r, g, ks = t.rows, t.groups, t.k_sub
  pieces = v_pieces(dz_g.shape[-1])
  kb, blk, n = (jax.lax.axis_index(name) for name in ("k", "b", "n"))
  batch, head = n // heads, n % heads
  steps, chunks, kcols = pl.ds(blk * r, r), pl.ds(blk * g, g), pl.ds(kb * ks, ks)

  plgpu.copy_gmem_to_smem(q_g.at[batch, steps, head, kcols], s.q, bar)
  plgpu.copy_gmem_to_smem(k_g.at[batch, steps, head, kcols], s.k, bar)
  plgpu.copy_gmem_to_smem(rows_g.at[n, blk], s.rows, bar)
  plgpu.copy_gmem_to_smem(vrows_g.at[n, blk], s.vrows, bar)
  plgpu.copy_gmem_to_smem(bk_g.at[n, chunks], s.bk, bar)
  for p, (start, _) in enumerate(pieces):
    for x_g, x_s in ((dz_g, s.dz), (v_g, s.v)):
      plgpu.copy_gmem_to_smem(x_g.at[batch, steps, head, pl.ds(start, V_PIECE)], x_s.at[p],
                              bar)
    for c in range(g):
      plgpu.copy_gmem_to_smem(n_g.at[n, blk * g + c, pl.ds(start, V_PIECE), kcols],
                              s.n.at[c, p], bar)
  plgpu.barrier_wait(bar)
  last, overlap = len(pieces) - 1, pieces[-1][1]
  if overlap:  # The last piece's first columns are its predecessor's: out of its products.
    col = plgpu.broadcasted_iota(jnp.int32, (r, V_PIECE), 1, layout=WGMMA)
    s.dz[last] = jnp.where(col < overlap, 0.0, plgpu.load(s.dz.at[last], layout=WGMMA)
                           .astype(f32)).astype(bf16)

  row = lambda i: plgpu.load(s.rows.at[i], layout=ROW)
  vrow = lambda i: plgpu.load(s.vrows.at[i], layout=ROW)
  over_k = lambda x: jax.lax.broadcast_in_dim(x, (r, ks), (0,))
  f, cs, ip, mb = row(ROW_F), row(ROW_CS), row(ROW_IP), row(ROW_MB)
  in_chunk = lambda c, x: x if g == 1 else jnp.where(chunk_mask(r, ks, chunk, c), x, 0.0)

  # The forward's qk on these columns (reads_forward.py), and dS.
  k = plgpu.load(s.k, layout=WGMMA).astype(f32)
  ksq = k * k
  x = ksq * over_k(mb)
  s.x[...] = x.astype(bf16)
  decay = decay_matrix(s.rows, r)
  s.d[...] = decay.astype(bf16)
  s.sel[...] = chunk_sums_selector(s.rows, r, chunk).astype(bf16)
  plgpu.commit_smem()

  def score_grads(acc_w):
    for p in range(len(pieces)):
      plgpu.wgmma(acc_w, s.dz.at[p], s.v.at[p].transpose((1, 0)))
    return acc_w[...]

  s.ds[...] = (pl.run_scoped(score_grads, plgpu.ACC((r, r), f32)) * decay).astype(bf16)
  ak = matmul(s.d, s.x, (r, ks))
  bk = per_chunk_rows(lambda c: plgpu.load(s.bk.at[c, kcols], layout=COL), r, chunk, g, ks)
  ibk = over_k(f) * bk + ak + over_k(ip)
  q = plgpu.load(s.q, layout=WGMMA).astype(f32)
  qk = q / ibk
  s.q[...] = qk.astype(bf16)  # Each thread rewrites what it read: no barrier needed.
  for c in range(g):
    s.qkc[c] = in_chunk(c, over_k(cs) * qk).astype(bf16)
  plgpu.commit_smem()

  # dqk = dS @ k + cs (dZ @ N of each row's chunk) + dsigma q.
  def key_grads(acc_s, *acc_c):
    plgpu.wgmma(acc_s, s.ds, s.k)
    for c in range(g):
      for p in range(len(pieces)):
        plgpu.wgmma(acc_c[c], s.dz.at[p], s.n.at[c, p])
    return acc_s[...], [a[...] for a in acc_c]

  dqk, carried = pl.run_scoped(key_grads, *[plgpu.ACC((r, ks), f32)] * (1 + g))
  for c in range(g):
    dqk = dqk + over_k(cs) * in_chunk(c, carried[c])
  d_sigma = vrow(VROW_SIGMA)
  if with_var:
    dqk = dqk + over_k(d_sigma) * q
  dq = dqk / ibk + (over_k(d_sigma) * qk if with_var else 0.0)
  true_k = kb * ks + plgpu.broadcasted_iota(jnp.int32, (r, ks), 1, layout=WGMMA) < k_true
  dibk = jnp.where(true_k, over_k(vrow(VROW_IBS)) * (1.0 / k_true) - dqk * qk / ibk, 0.0)
  s.krows[KROW_F] = jnp.sum(dibk * bk, axis=1)
  s.krows[KROW_IP] = jnp.sum(dibk, axis=1)
  s.krows[KROW_G_ROWS] = jnp.sum(dibk * ak, axis=1)
  s.dak[...] = dibk.astype(bf16)
  s.dq[...] = dq.astype(bf16)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(s.dq, dq_g.at[batch, steps, head, kcols])

  def marginal_grads(acc_k, acc_x, acc_bk):
    plgpu.wgmma(acc_k, s.ds.transpose((1, 0)), s.q)
    plgpu.wgmma(acc_x, s.d.transpose((1, 0)), s.dak)
    plgpu.wgmma(acc_bk, s.sel, s.dak)
    return acc_k[...], acc_x[...], acc_bk[...]

  dk, dx, dbk = pl.run_scoped(marginal_grads, plgpu.ACC((r, ks), f32), plgpu.ACC((r, ks), f32),
                              plgpu.ACC((MIN_ROWS, ks), f32))
  dk = dk + 2.0 * k * (dx * over_k(mb) + over_k(vrow(VROW_MK)) * (1.0 / k_true))
  s.krows[KROW_G_COLS] = jnp.sum(dx * x, axis=1)
  s.krows[KROW_MB] = jnp.sum(dx * ksq, axis=1)
  s.dk[...] = dk.astype(bf16)
  s.dbk[...] = dbk
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(s.dk, dk_g.at[batch, steps, head, kcols], commit_group=False)
  plgpu.copy_smem_to_gmem(s.krows, krows_g.at[n, blk, kb], commit_group=False)
  plgpu.copy_smem_to_gmem(s.dbk.at[pl.ds(0, g)], dbk_g.at[n, chunks, kcols],
                          commit_group=False)
  plgpu.commit_smem_to_gmem_group()

  # dN of chunk c = dZ^T @ (cs qk on chunk c's rows), 64 V rows at a time (rows past Vp
  # are not stored: TMA bounds; the last piece stores only the rows it owns).
  vp = dz_g.shape[-1]
  for c in range(g):
    for p, (start, skip) in enumerate(pieces):
      dn = matmul(s.dz.at[p].transpose((1, 0)), s.qkc.at[c], (V_PIECE, ks))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      s.dn[...] = dn
      plgpu.commit_smem()
      owned = min(V_PIECE, vp) - skip
      plgpu.copy_smem_to_gmem(s.dn.at[pl.ds(skip, owned)],
                              dn_g.at[n, blk * g + c, pl.ds(start + skip, owned), kcols])
  plgpu.wait_smem_to_gmem(0)


def backward_k(q, k, v, rows, bk, dz, vrows, n_c, *, heads: int, chunk: int, k_true: int,
               with_var: bool, tiles: BackwardTiles, interpret):
  """The K-side kernel. q, k, v, rows, n_c as `reads_backward.chunk_reads_backward`'s (bk
  padded to `tiles.k_span(Kp)`); dz, vrows: `reads_backward_v.backward_v`'s.

  Returns dq, dk [B, Tp, H, Kp] (q's dtype), krows [BH, NB, K-blocks, NUM_KROWS, R], dbk
  [BH, NC, k_span] and dn [BH, NC, Vp, Kp] float32.
  """
  kp, vp = q.shape[-1], dz.shape[-1]
  bh, nb = rows.shape[:2]
  scratch, unpack = _scratch(tiles, kp, vp)
  sds = jax.ShapeDtypeStruct
  out_type = [sds(q.shape, q.dtype), sds(k.shape, k.dtype),
              sds((bh, nb, tiles.k_blocks(kp), NUM_KROWS, tiles.rows), f32),
              sds(bk.shape, f32), sds(n_c.shape, f32)]
  # No automatic barriers: the rows arrive by TMA before the barrier wait; what threads
  # store for the tensor cores or a copy out is made visible by commit_smem first; dN's
  # staging buffer is rewritten only after its last copy out has read it.
  kernel = mosaic_kernel(
      functools.partial(_kernel, heads=heads, chunk=chunk, k_true=k_true, with_var=with_var,
                        t=tiles, unpack=unpack),
      out_type=out_type, scratch_types=scratch, grid=(tiles.k_blocks(kp), nb, bh),
      grid_names=("k", "b", "n"), interpret=interpret, name="fast_palimpsa_reads_backward_k")
  return tuple(kernel(q, k, v, rows, bk, dz, vrows, n_c))
