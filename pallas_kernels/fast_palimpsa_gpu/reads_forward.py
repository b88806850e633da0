"""Fast Palimpsa's chunk reads, forward, as one Pallas Mosaic GPU kernel (Hopper, wgmma).

One CTA (a warpgroup) reads one group of G chunks (R = G * C rows, at least 64: the M of a
wgmma) of one batch*head, for one block of V columns, from the exact states entering the
chunks (computed before, by the boundary kernel). Everything inside the chunk stays in
registers or shared memory; the rows come by TMA once, `out` (and the variance) leave by
TMA once. With D [R, R] the decay matrix (exp(g_t - g_s) for s <= t in one segment of one
chunk, else 0), f_t the decay from the chunk start, and per chunk bk = mean_v Ibar_c [K],
bv = mean_k Ibar_c [V], N = mu_c * (bv + Ip) (x) (bk + Ip) [V, K] (`reads.chunk_start_terms`,
`reads.weighted_mean`):

    Ak = D @ (mb * k^2)            (tensor cores)   ibk = f bk + Ak + Ip        [R, K]
    qk = q / ibk                                    ibs = mean_k ibk           [R]
    W = (qk @ k^T) * D             (tensor cores)                              [R, R]
  per V sub-tile of `sub` columns:
    Av = D @ (beta * mk)           (tensor cores)   ibv = f bv + Av + Ip        [R, sub]
    Z = W @ v + cs (qk @ N^T)      (tensor cores)   out = Z * ibs / ibv
    variance = sum_k(q qk) * ibs / ibv

mb = mean_v beta and cs = f / mean(Ibar_c + Ip) are per-step rows computed outside, mk =
mean_k k^2 inside. The wgmma operands are bfloat16 (the inputs' dtype; D, W, qk and the
k^2 and beta products rounded to it), the accumulators float32: a bfloat16 call's
accuracy. With G > 1 chunks per CTA, D is block-diagonal and the chunk-start terms are
selected per row (bk, bv) or per chunk (one N product per chunk, its rows masked).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fast_palimpsa_gpu.tiles import (ROW_CS, ROW_F, ROW_G, ROW_ID, ROW_IP,
                                                    ROW_MB, NUM_ROWS, ForwardTiles,
                                                    padded_width, tiled)
from pallas_kernels.palimpsa_gpu.launch_mosaic import mosaic_kernel
from pallas_kernels.palimpsa_gpu.mosaic_tiles import smem_bytes_of

f32, bf16 = jnp.float32, jnp.bfloat16
WGMMA = plgpu.Layout.WGMMA
ROW = WGMMA.reduce(1)  # [R] indexed by the row (step t) of a [R, N] WGMMA array.
COL = WGMMA.reduce(0)  # [N] indexed by the column.


def _scratch(t: ForwardTiles, kp: int, vp: int, out_dtype, with_var: bool) -> list:
  """Shared memory in `_kernel`'s order. Every wgmma operand, A included, is read from
  shared memory (bfloat16, swizzled): A from registers is not interpreted on CPU, and
  shared memory gives the transposes the backward needs for free."""
  smem, r, g, sub, nsub = plgpu.SMEM, t.rows, t.groups, t.sub, t.num_sub
  # The A and B operands of a wgmma share a swizzle: one for all, whose tile divides every
  # width (K, the rows, the V sub-tile).
  ops = tiled(bf16, kp, r, sub, vp)
  scratch = [
      smem((r, kp), bf16, transforms=ops),  # q, then q / ibk
      smem((r, kp), bf16, transforms=ops),  # k
      smem((r, kp), bf16, transforms=ops),  # mb k^2
      smem((r, r), bf16, transforms=ops),  # D
      smem((r, r), bf16, transforms=ops),  # W
      smem((nsub, r, sub), bf16, transforms=ops),  # v
      smem((nsub, r, sub), bf16, transforms=ops),  # beta, then beta * mk
      smem((nsub, g, sub, kp), bf16, transforms=ops),  # N
      smem((NUM_ROWS, r), f32),
      smem((g, padded_width(kp)), f32),  # bk
      smem((g, t.v_span(vp)), f32),  # bv
      smem((nsub, r, sub), out_dtype, transforms=tiled(out_dtype, sub, vp)),
  ]
  if with_var:
    scratch.append(smem((nsub, r, sub), f32, transforms=tiled(f32, sub, vp)))
  return scratch


def smem_bytes(t: ForwardTiles, kp: int, vp: int, out_dtype, with_var: bool) -> int:
  return smem_bytes_of(_scratch(t, kp, vp, out_dtype, with_var))


def decay_matrix(rows_s, r: int):
  """D [R, R] float32 (WGMMA): exp(g_t - g_s) where s <= t in one segment (ids equal),
  else 0."""
  g_row, g_col = (plgpu.load(rows_s.at[ROW_G], layout=lay) for lay in (ROW, COL))
  id_row, id_col = (plgpu.load(rows_s.at[ROW_ID], layout=lay) for lay in (ROW, COL))
  over_rows = lambda x: jax.lax.broadcast_in_dim(x, (r, r), (0,))
  over_cols = lambda x: jax.lax.broadcast_in_dim(x, (r, r), (1,))
  t = plgpu.broadcasted_iota(jnp.int32, (r, r), 0, layout=WGMMA)
  s = plgpu.broadcasted_iota(jnp.int32, (r, r), 1, layout=WGMMA)
  mask = (s <= t) & (over_rows(id_row) == over_cols(id_col))
  # The exponent only where it is used: elsewhere it may overflow.
  diff = jnp.where(mask, over_rows(g_row) - over_cols(g_col), 0.0)
  return jnp.where(mask, jnp.exp(diff), 0.0)


def per_chunk_rows(load_row, r: int, chunk: int, groups: int, width: int):
  """[R, width]: row t holds load_row(c) (a [width] COL vector) of its chunk c = t // chunk."""
  full = lambda c: jax.lax.broadcast_in_dim(load_row(c), (r, width), (1,))
  out = full(0)
  if groups > 1:
    t = plgpu.broadcasted_iota(jnp.int32, (r, width), 0, layout=WGMMA)
    for c in range(1, groups):
      out = jnp.where(t >= c * chunk, full(c), out)
  return out


def chunk_mask(r: int, width: int, chunk: int, c: int):
  """[R, width] bool (WGMMA): the rows of chunk c of the group."""
  t = plgpu.broadcasted_iota(jnp.int32, (r, width), 0, layout=WGMMA)
  return (t >= c * chunk) & (t < (c + 1) * chunk)


def carried_read(qk_s, n_s, r: int, sub: int, chunk: int):
  """[R, sub] float32: row t of qk_s [R, Kp] times N^T of its chunk, N = n_s[c] [sub, Kp]
  (n_s [G, sub, Kp]): one product per chunk, each chunk's rows kept."""
  groups = n_s.shape[0]
  rc = None
  for c in range(groups):
    part = matmul(qk_s, n_s.at[c].transpose((1, 0)), (r, sub))
    if groups > 1:
      part = jnp.where(chunk_mask(r, sub, chunk, c), part, 0.0)
    rc = part if rc is None else rc + part
  return rc


def matmul(a, b, shape):
  """a @ b (shared-memory refs) on the tensor cores into a fresh float32 accumulator."""
  def run(acc):
    plgpu.wgmma(acc, a, b)
    return acc[...]
  return pl.run_scoped(run, plgpu.ACC(shape, f32))


def _kernel(q_g, k_g, v_g, beta_g, rows_g, bk_g, bv_g, n_g, *refs, heads, chunk, k_true,
            with_var, t: ForwardTiles):
  """One CTA: the reads of one (batch*head n, group of chunks, V-block).

  q_g, k_g [B, Tp, H, Kp]; v_g, beta_g [B, Tp, H, Vp]; rows_g [BH, NB, NUM_ROWS, R];
  bk_g [BH, NC, KW], bv_g [BH, NC, span]; n_g [BH, NC, Vp, Kp]; then the outputs out (and
  variance) [B, Tp, H, Vp], the scratch of `_scratch` and one barrier.
  """
  outs, refs = (refs[:2], refs[2:]) if with_var else (refs[:1], refs[1:])
  (q_s, k_s, x_s, d_s, w_s, v_s, beta_s, n_s, rows_s, bk_s, bv_s, out_s, *rest) = refs
  var_s, bar = (rest[0], rest[1]) if with_var else (None, rest[0])
  r, g, sub, nsub = t.rows, t.groups, t.sub, t.num_sub
  kp = q_s.shape[-1]
  vb, blk, n = (jax.lax.axis_index(name) for name in ("v", "b", "n"))
  batch, head = n // heads, n % heads
  steps = pl.ds(blk * r, r)
  chunks = pl.ds(blk * g, g)
  cols = [pl.ds((vb * nsub + j) * sub, sub) for j in range(nsub)]

  plgpu.copy_gmem_to_smem(q_g.at[batch, steps, head], q_s, bar)
  plgpu.copy_gmem_to_smem(k_g.at[batch, steps, head], k_s, bar)
  plgpu.copy_gmem_to_smem(rows_g.at[n, blk], rows_s, bar)
  plgpu.copy_gmem_to_smem(bk_g.at[n, chunks], bk_s, bar)
  plgpu.copy_gmem_to_smem(bv_g.at[n, chunks], bv_s, bar)
  for j, c in enumerate(cols):
    plgpu.copy_gmem_to_smem(v_g.at[batch, steps, head, c], v_s.at[j], bar)
    plgpu.copy_gmem_to_smem(beta_g.at[batch, steps, head, c], beta_s.at[j], bar)
    for i in range(g):  # One chunk per copy: a TMA box has at most 5 dimensions.
      plgpu.copy_gmem_to_smem(n_g.at[n, blk * g + i, c], n_s.at[j, i], bar)
  plgpu.barrier_wait(bar)

  row = lambda i: plgpu.load(rows_s.at[i], layout=ROW)
  over_k = lambda x: jax.lax.broadcast_in_dim(x, (r, kp), (0,))
  over_v = lambda x: jax.lax.broadcast_in_dim(x, (r, sub), (0,))
  f, cs, ip = row(ROW_F), row(ROW_CS), row(ROW_IP)

  # Every thread rewrites in place only what it read itself (the same layout), so the
  # in-place stores need no barrier; commit_smem then shows them to the tensor cores.
  k = plgpu.load(k_s, layout=WGMMA).astype(f32)
  ksq = k * k
  x_s[...] = (ksq * over_k(row(ROW_MB))).astype(bf16)
  mk = jnp.sum(ksq, axis=1) * (1.0 / k_true)
  for j in range(nsub):
    beta = plgpu.load(beta_s.at[j], layout=WGMMA).astype(f32)
    beta_s[j] = (beta * over_v(mk)).astype(bf16)
  decay = decay_matrix(rows_s, r)
  d_s[...] = decay.astype(bf16)
  q = plgpu.load(q_s, layout=WGMMA).astype(f32)
  plgpu.commit_smem()

  ak = matmul(d_s, x_s, (r, kp))
  bk = per_chunk_rows(lambda c: plgpu.load(bk_s.at[c, pl.ds(0, kp)], layout=COL), r, chunk, g, kp)
  ibk = over_k(f) * bk + ak + over_k(ip)
  qk = q / ibk
  # Mean over the true K: the padded columns hold ibk = Ip.
  ibs = (jnp.sum(ibk, axis=1) - (kp - k_true) * ip) * (1.0 / k_true)
  sigma = jnp.sum(q * qk, axis=1) if with_var else None
  q_s[...] = qk.astype(bf16)
  plgpu.commit_smem()

  scores = matmul(q_s, k_s.transpose((1, 0)), (r, r))
  w_s[...] = (scores * decay).astype(bf16)
  plgpu.commit_smem()

  for j in range(nsub):
    def reads(acc_v, acc_own, j=j):
      plgpu.wgmma(acc_v, d_s, beta_s.at[j])
      plgpu.wgmma(acc_own, w_s, v_s.at[j])
      return acc_v[...], acc_own[...]

    av, own = pl.run_scoped(reads, plgpu.ACC((r, sub), f32), plgpu.ACC((r, sub), f32))
    z = own + over_v(cs) * carried_read(q_s, n_s.at[j], r, sub, chunk)
    bv = per_chunk_rows(lambda c, j=j: plgpu.load(bv_s.at[c, cols[j]], layout=COL), r,
                        chunk, g, sub)
    scale = over_v(ibs) / (over_v(f) * bv + av + over_v(ip))
    out_s[j] = (z * scale).astype(out_s.dtype)
    if with_var:
      var_s[j] = over_v(sigma) * scale
  plgpu.commit_smem()
  for j, c in enumerate(cols):
    plgpu.copy_smem_to_gmem(out_s.at[j], outs[0].at[batch, steps, head, c])
    if with_var:
      plgpu.copy_smem_to_gmem(var_s.at[j], outs[1].at[batch, steps, head, c])
  plgpu.wait_smem_to_gmem(0)


def chunk_reads_forward(q, k, v, beta, rows, bk, bv, n_c, *, heads: int, chunk: int,
                        k_true: int, with_var: bool, tiles: ForwardTiles, interpret):
  """out (v's dtype) and the variance (float32, or None) [B, Tp, H, Vp] of every chunk.

  q, k [B, Tp, H, Kp], v, beta [B, Tp, H, Vp] bfloat16 (Tp a multiple of tiles.rows, Kp and
  Vp of 16, zero padding); rows [BH, Tp / R, NUM_ROWS, R] float32 (`tiles.py`'s rows);
  bk [BH, NC, KW] float32 (`tiles.padded_width`), bv [BH, NC, tiles.v_span(Vp)] float32;
  n_c [BH, NC, Vp, Kp] bfloat16.
  k_true: K before padding (the means over K).
  """
  b, tp, _, kp = q.shape
  vp = v.shape[-1]
  bh, nb = rows.shape[:2]
  sds = jax.ShapeDtypeStruct
  out_type = [sds((b, tp, heads, vp), v.dtype)] + (
      [sds((b, tp, heads, vp), f32)] if with_var else [])
  # No automatic barriers: the rows arrive by TMA before the barrier wait; x, y and the
  # staged outputs are made visible by commit_smem before the tensor cores or TMA read them.
  kernel = mosaic_kernel(
      functools.partial(_kernel, heads=heads, chunk=chunk, k_true=k_true, with_var=with_var,
                        t=tiles),
      out_type=out_type,
      scratch_types=_scratch(tiles, kp, vp, v.dtype, with_var) + [
          plgpu.Barrier(num_arrivals=5 + (2 + tiles.groups) * tiles.num_sub)],
      grid=(tiles.v_blocks(vp), nb, bh), grid_names=("v", "b", "n"), interpret=interpret,
      name="fast_palimpsa_reads_forward")
  res = kernel(q, k, v, beta, rows, bk, bv, n_c)
  return (res[0], res[1]) if with_var else (res[0], None)
