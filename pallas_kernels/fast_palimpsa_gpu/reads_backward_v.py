"""The V-side kernel of the reads' backward (reads_backward.py): what needs the V-indexed rows.

One CTA (a warpgroup) per (batch*head, group of chunks), over all of V in sub-tiles of
`sub` columns whose rows (v, beta, dout, N and the variance's cotangent) come by TMA
through a ring of `slots` slots. It recomputes the forward's V-independent part (D, ibk,
qk, ibs, W) and per sub-tile Av, ibv, own and the carried read Rc, then writes dv, dbeta
(the reads' share), dZ (bfloat16, for the K-side kernel), dS = dW * D [R, R] (bfloat16),
dbv and the per-step rows of `VROW_*`. The [R, R] running sums dW and dAv @ Y^T are the
only accumulators held over the sub-tiles.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fast_palimpsa_gpu.reads_forward import (COL, ROW, WGMMA, carried_read,
                                                            chunk_mask, decay_matrix,
                                                            matmul, per_chunk_rows)
from pallas_kernels.fast_palimpsa_gpu.tiles import (ROW_CS, ROW_F, ROW_IP, ROW_MB, NUM_ROWS,
                                                    BackwardTiles, padded_width, tiled)
from pallas_kernels.palimpsa_gpu.launch import mosaic_kernel
from pallas_kernels.palimpsa_gpu.mosaic_tiles import smem_bytes_of

f32, bf16 = jnp.float32, jnp.bfloat16

# The per-step rows the kernel writes, [BH, NB, NUM_VROWS, R] float32: dg's two halves
# from dD's V-side part (row sums, column sums of P), the cotangents of f, cs and Ip, and
# what the K-side kernel needs: dsigma, dibs and dmk.
(VROW_G_ROWS, VROW_G_COLS, VROW_F, VROW_CS, VROW_IP, VROW_SIGMA, VROW_IBS,
 VROW_MK) = range(8)
NUM_VROWS = 8


@dataclasses.dataclass(frozen=True)
class _Smem:
  """The kernel's shared memory by name (`_scratch`)."""

  qk: object  # [R, Kp] q, then q / ibk
  k: object
  x: object  # mb k^2
  d: object  # [R, R] D
  w: object  # [R, R] W, then dS (staging)
  rows: object  # [NUM_ROWS, R]
  bk: object  # [G, KW]
  bv: object  # [G, span]
  dbv: object  # [G, span] staging
  drows: object  # [NUM_VROWS, R] staging
  ring: dict  # v, beta, dout [slots, R, sub]; n [slots, G, sub, Kp]; dvar (variance)
  stage: dict  # y, dz, dav (wgmma operands), dv, dbeta (copies out) [R, sub]


def _scratch(t: BackwardTiles, kp: int, vp: int, with_var: bool):
  """(scratch types, a function of the kernel's scratch refs -> (_Smem, barriers))."""
  smem, r, g, sub, slots = plgpu.SMEM, t.rows, t.groups, t.sub, t.slots
  span = t.v_span(vp)
  ops = tiled(bf16, kp, r, sub, vp)  # One swizzle for every wgmma operand (A and B share it).
  rk = lambda: smem((r, kp), bf16, transforms=ops)
  rr = lambda: smem((r, r), bf16, transforms=ops)
  rv = lambda *n: smem((*n, r, sub), bf16, transforms=ops)
  ring = dict(v=rv(slots), beta=rv(slots), dout=rv(slots),
              n=smem((slots, g, sub, kp), bf16, transforms=ops))
  if with_var:
    ring["dvar"] = smem((slots, r, sub), f32, transforms=tiled(f32, sub, vp))
  stage = {name: rv() for name in ("y", "dz", "dav", "dv", "dbeta")}
  fixed = dict(qk=rk(), k=rk(), x=rk(), d=rr(), w=rr(), rows=smem((NUM_ROWS, r), f32),
               bk=smem((g, padded_width(kp)), f32), bv=smem((g, span), f32),
               dbv=smem((g, span), f32), drows=smem((NUM_VROWS, r), f32))
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


def accumulate(products, sums, interpret):
  """sums + the wgmma products that products(*accumulators) issues into accumulators
  starting from zero. Compiled, the accumulators start at sums (run_state: no extra
  registers); interpreted (whose wgmma takes only scoped accumulators), they start at zero
  and are added to sums."""
  if not interpret:
    return pl.run_state(lambda accs: products(*accs))(tuple(plgpu.ACC.init(x) for x in sums))

  def fresh(*accs):
    products(*accs)
    return tuple(a[...] for a in accs)

  parts = pl.run_scoped(fresh, *[plgpu.ACC(x.shape, f32) for x in sums])
  return tuple(x + part for x, part in zip(sums, parts))


def _kernel(*refs, heads, chunk, k_true, with_var, num_sub, t: BackwardTiles, unpack,
            interpret):
  """One CTA: the V-side backward of the reads of one (batch*head n, group of chunks).

  refs: q, k [B, Tp, H, Kp]; v, beta, dout [B, Tp, H, Vp]; dvar [B, Tp, H, Vp] (with the
  variance); rows [BH, NB, NUM_ROWS, R]; bk [BH, NC, KW]; bv [BH, NC, span]; n [BH, NC, Vp,
  Kp]; then the outputs dv, dbeta, dz [B, Tp, H, Vp] (bfloat16), ds [BH, NB, R, R]
  (bfloat16), vrows [BH, NB, NUM_VROWS, R], dbv [BH, NC, span] (float32); then the scratch
  of `_scratch`.
  """
  n_in = 10 if with_var else 9
  ins, outs, scratch = refs[:n_in], refs[n_in:n_in + 6], refs[n_in + 6:]
  if with_var:
    q_g, k_g, v_g, beta_g, dout_g, dvar_g, rows_g, bk_g, bv_g, n_g = ins
  else:
    (q_g, k_g, v_g, beta_g, dout_g, rows_g, bk_g, bv_g, n_g), dvar_g = ins, None
  dv_g, dbeta_g, dz_g, ds_g, vrows_g, dbv_g = outs
  s, setup_bar, ring_bars = unpack(scratch)
  ring, stage = s.ring, s.stage
  r, g, sub, slots = t.rows, t.groups, t.sub, t.slots
  kp = s.k.shape[-1]
  blk, n = jax.lax.axis_index("b"), jax.lax.axis_index("n")
  batch, head = n // heads, n % heads
  steps, chunks = pl.ds(blk * r, r), pl.ds(blk * g, g)
  cols = [pl.ds(j * sub, sub) for j in range(num_sub)]

  plgpu.copy_gmem_to_smem(q_g.at[batch, steps, head], s.qk, setup_bar)
  plgpu.copy_gmem_to_smem(k_g.at[batch, steps, head], s.k, setup_bar)
  plgpu.copy_gmem_to_smem(rows_g.at[n, blk], s.rows, setup_bar)
  plgpu.copy_gmem_to_smem(bk_g.at[n, chunks], s.bk, setup_bar)
  plgpu.copy_gmem_to_smem(bv_g.at[n, chunks], s.bv, setup_bar)

  def fetch(j):  # Sub-tile j's rows into slot j % slots.
    slot, bar = j % slots, ring_bars.at[j % slots]
    rows_of = lambda x_g: x_g.at[batch, steps, head, cols[j]]
    plgpu.copy_gmem_to_smem(rows_of(v_g), ring["v"].at[slot], bar)
    plgpu.copy_gmem_to_smem(rows_of(beta_g), ring["beta"].at[slot], bar)
    plgpu.copy_gmem_to_smem(rows_of(dout_g), ring["dout"].at[slot], bar)
    if with_var:
      plgpu.copy_gmem_to_smem(rows_of(dvar_g), ring["dvar"].at[slot], bar)
    for c in range(g):  # One chunk per copy: a TMA box has at most 5 dimensions.
      plgpu.copy_gmem_to_smem(n_g.at[n, blk * g + c, cols[j]], ring["n"].at[slot, c], bar)

  for j in range(min(slots, num_sub)):
    fetch(j)
  plgpu.barrier_wait(setup_bar)

  row = lambda i: plgpu.load(s.rows.at[i], layout=ROW)
  over_k = lambda x: jax.lax.broadcast_in_dim(x, (r, kp), (0,))
  over_v = lambda x: jax.lax.broadcast_in_dim(x, (r, sub), (0,))
  f, cs, ip = row(ROW_F), row(ROW_CS), row(ROW_IP)
  zeros = lambda shape: plgpu.layout_cast(jnp.zeros(shape, f32), WGMMA)
  row_zeros = lambda: plgpu.layout_cast(jnp.zeros((r,), f32), ROW)

  # The forward's V-independent part (reads_forward.py), qk over q in shared memory.
  k = plgpu.load(s.k, layout=WGMMA).astype(f32)
  ksq = k * k
  s.x[...] = (ksq * over_k(row(ROW_MB))).astype(bf16)
  mk = jnp.sum(ksq, axis=1) * (1.0 / k_true)
  s.d[...] = decay_matrix(s.rows, r).astype(bf16)
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

  # Running sums over the sub-tiles: dW and dAv @ Y^T (part of dD), and per-step rows.
  d_w, d_dv = zeros((r, r)), zeros((r, r))
  d_sigma, d_ibs, d_cs, d_f, d_ip, d_mk = (row_zeros() for _ in range(6))

  for j in range(num_sub):
    slot = j % slots
    plgpu.barrier_wait(ring_bars.at[slot])
    beta = plgpu.load(ring["beta"].at[slot], layout=WGMMA).astype(f32)
    stage["y"][...] = (beta * over_v(mk)).astype(bf16)
    plgpu.commit_smem()

    def reads(acc_v, acc_own, slot=slot):
      plgpu.wgmma(acc_v, s.d, stage["y"])
      plgpu.wgmma(acc_own, s.w, ring["v"].at[slot])
      return acc_v[...], acc_own[...]

    av, own = pl.run_scoped(reads, *[plgpu.ACC((r, sub), f32)] * 2)
    rc = carried_read(s.qk, ring["n"].at[slot], r, sub, chunk)
    bv = per_chunk_rows(lambda c, j=j: plgpu.load(s.bv.at[c, cols[j]], layout=COL), r, chunk,
                        g, sub)
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
    if g == 1:
      s.dbv[0, cols[j]] = jnp.sum(over_v(f) * dibv, axis=0)
    else:
      for c in range(g):
        s.dbv[c, cols[j]] = jnp.sum(jnp.where(chunk_mask(r, sub, chunk, c),
                                              over_v(f) * dibv, 0.0), axis=0)
    # Copies out are committed in groups, oldest first: (dz), then (dv, dbeta), per
    # sub-tile. dz's buffer is free once the last sub-tile's dz group is read.
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
    stage["dz"][...] = dz.astype(bf16)
    stage["dav"][...] = dibv.astype(bf16)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(stage["dz"], dz_g.at[batch, steps, head, cols[j]])

    def running(acc_w, acc_dd, slot=slot):
      plgpu.wgmma(acc_w, stage["dz"], ring["v"].at[slot].transpose((1, 0)))
      plgpu.wgmma(acc_dd, stage["dav"], stage["y"].transpose((1, 0)))

    d_w, d_dv = accumulate(running, (d_w, d_dv), interpret)

    def row_grads(acc_dv, acc_dy):
      plgpu.wgmma(acc_dv, s.w.transpose((1, 0)), stage["dz"])
      plgpu.wgmma(acc_dy, s.d.transpose((1, 0)), stage["dav"])
      return acc_dv[...], acc_dy[...]

    dv, dy = pl.run_scoped(row_grads, *[plgpu.ACC((r, sub), f32)] * 2)
    beta = plgpu.load(ring["beta"].at[slot], layout=WGMMA).astype(f32)
    d_mk = d_mk + jnp.sum(dy * beta, axis=1)
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # The last sub-tile's dv and dbeta.
    stage["dv"][...] = dv.astype(bf16)
    stage["dbeta"][...] = (dy * over_v(mk)).astype(bf16)
    plgpu.commit_smem()  # Also: every thread is done with the slot, which may refill.
    plgpu.copy_smem_to_gmem(stage["dv"], dv_g.at[batch, steps, head, cols[j]],
                            commit_group=False)
    plgpu.copy_smem_to_gmem(stage["dbeta"], dbeta_g.at[batch, steps, head, cols[j]],
                            commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    if j + slots < num_sub:
      fetch(j + slots)

  # dD's V-side part: P = (dAv @ Y^T + dW * S) * D, whose row and column sums are dg's.
  # W's buffer stages dS = dW * D (the last products that read W have completed).
  decay = decay_matrix(s.rows, r)
  scores = matmul(s.qk, s.k.transpose((1, 0)), (r, r))
  s.w[...] = (d_w * decay).astype(bf16)
  p = (d_dv + d_w * scores) * decay
  vrows = {VROW_G_ROWS: jnp.sum(p, axis=1), VROW_F: d_f, VROW_CS: d_cs, VROW_IP: d_ip,
           VROW_IBS: d_ibs, VROW_MK: d_mk,
           VROW_SIGMA: d_sigma if with_var else row_zeros()}
  for i, vec in vrows.items():
    s.drows[i] = vec
  s.drows[VROW_G_COLS] = jnp.sum(p, axis=0)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(s.w, ds_g.at[n, blk], commit_group=False)
  plgpu.copy_smem_to_gmem(s.drows, vrows_g.at[n, blk], commit_group=False)
  plgpu.copy_smem_to_gmem(s.dbv, dbv_g.at[n, chunks], commit_group=False)
  plgpu.commit_smem_to_gmem_group()
  plgpu.wait_smem_to_gmem(0)


def backward_v(q, k, v, beta, rows, bk, bv, n_c, dout, dvar, *, heads: int, chunk: int,
               k_true: int, tiles: BackwardTiles, interpret):
  """The V-side kernel. Arguments as `reads_backward.chunk_reads_backward`'s (bk padded to
  `padded_width(Kp)`, bv to `tiles.v_span(Vp)`).

  Returns dv, dbeta, dz [B, Tp, H, Vp] (v's dtype), ds [BH, NB, R, R] bfloat16, vrows
  [BH, NB, NUM_VROWS, R] and dbv [BH, NC, span] float32.
  """
  vp = v.shape[-1]
  bh, nb = rows.shape[:2]
  with_var = dvar is not None
  scratch, unpack = _scratch(tiles, q.shape[-1], vp, with_var)
  sds = jax.ShapeDtypeStruct
  out_type = [sds(v.shape, v.dtype), sds(beta.shape, beta.dtype), sds(v.shape, v.dtype),
              sds((bh, nb, tiles.rows, tiles.rows), bf16),
              sds((bh, nb, NUM_VROWS, tiles.rows), f32), sds(bv.shape, f32)]
  # No automatic barriers: rows arrive by TMA before their barrier waits; what threads
  # store for the tensor cores or a copy out is made visible by commit_smem first; a
  # staging buffer is rewritten only after its last copy out has read it; a ring slot is
  # refilled after the commit_smem that follows its last reads.
  kernel = mosaic_kernel(
      functools.partial(_kernel, heads=heads, chunk=chunk, k_true=k_true, with_var=with_var,
                        num_sub=tiles.num_sub(vp), t=tiles, unpack=unpack,
                        interpret=bool(interpret)),
      out_type=out_type, scratch_types=scratch, grid=(nb, bh), grid_names=("b", "n"),
      interpret=interpret, name="fast_palimpsa_reads_backward_v")
  ins = (q, k, v, beta, dout) + ((dvar,) if with_var else ()) + (rows, bk, bv, n_c)
  return tuple(kernel(*ins))
