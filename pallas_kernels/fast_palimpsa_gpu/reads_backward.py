"""Fast Palimpsa's chunk reads, backward, as one Pallas Mosaic GPU kernel (Hopper, wgmma).

The mirror of reads_forward.py: one CTA (a warpgroup) per (batch*head, group of chunks),
over all of V in sub-tiles of `sub` columns whose rows (v, beta, dout, N and the variance's
cotangent) come by TMA through a ring of `slots` slots. It recomputes what the forward
built in registers (D, ibk, qk, W, then per sub-tile Av, ibv, own, the carried read Rc)
and writes, once each: dq, dk, dv, dbeta (the reads' share), the cotangents of the
per-step rows (g, f, cs, Ip, mb), of the marginals bk and bv and of N. No float32
intermediate of the reads goes through device memory; dN [V, K] per chunk is the one
state-sized output (it becomes the state adjoints the carries kernel walks).

The gradients, by hand (forward as in reads_forward.py; Z = own + cs Rc, vs = ibs / ibv,
out = Z vs, variance = sigma vs with sigma = sum_k q qk; sums over the true K and V):

    dZ = dout vs                     dR = cs dZ
    dvs = dout Z + dvar sigma        dsigma = sum_v dvar vs
    dibs = sum_v dvs / ibv           dibv = -dvs vs / ibv          (dAv = dibv)
    dcs = sum_v dZ Rc                df += sum_v dibv bv            dIp += sum_v dibv
    dbv = sum_t f dibv (per chunk)
    dv = W^T @ dZ                    dW = dZ @ v^T                  (summed over sub-tiles)
    dN = dR^T @ qk (per chunk)       dqk = dR @ N + dS @ k + dsigma q
    dAv: dD += dAv @ Y^T,  dY = D^T @ dAv,  dbeta = dY mk,  dmk = sum_v dY beta
    dS = dW D,  dD += dW S,  dk = dS^T @ qk + 2 k dksq
    dq = dqk / ibk + dsigma qk,  dibk = -dqk qk / ibk + dibs / K   (dAk = dibk)
    df += sum_k dibk bk,  dIp += sum_k dibk,  dbk = sum_t f dibk (per chunk)
    dD += dAk @ X^T,  dX = D^T @ dAk,  dmb = sum_k dX k^2,  dksq = dX mb + dmk / K
    P = dD D:  dg_t = sum_s P[t, s] - sum_s P[s, t]

(Y = beta mk, X = mb k^2, S = qk @ k^T, W = S D.) The last line is dg's two halves, written
as two rows (DROW_G_ROWS, DROW_G_COLS) for XLA to subtract. Every product runs on the
tensor cores with bfloat16 operands read from shared memory (the transposes are views),
float32 accumulators.
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
from pallas_kernels.palimpsa_gpu.launch_mosaic import mosaic_kernel
from pallas_kernels.palimpsa_gpu.mosaic_tiles import smem_bytes_of

f32, bf16 = jnp.float32, jnp.bfloat16

# The rows of the per-step cotangents the kernel writes, [BH, NB, NUM_DROWS, R]:
DROW_G_ROWS, DROW_G_COLS, DROW_F, DROW_CS, DROW_IP, DROW_MB = range(6)
NUM_DROWS = 6


@dataclasses.dataclass(frozen=True)
class _Smem:
  """The kernel's shared memory by name (`_scratch`). `loop` and `post` share memory (a
  RefUnion): the sub-tile loop's ring, products and staging, then the buffers after it."""

  q: object  # [R, Kp]
  qk: object  # [R, Kp] q / ibk
  k: object
  x: object  # mb k^2
  d: object  # [R, R] D
  w: object  # [R, R] W
  rows: object  # [NUM_ROWS, R]
  bk: object  # [G, KW]
  bv: object  # [G, span]
  dbv: object  # [G, span] staging
  drows: object  # [NUM_DROWS, R] staging
  loop: dict
  post: dict


def _scratch(t: BackwardTiles, kp: int, vp: int, with_var: bool):
  """(scratch types, a function of the kernel's scratch refs -> (_Smem, barriers))."""
  smem, r, g, sub, slots = plgpu.SMEM, t.rows, t.groups, t.sub, t.slots
  span = t.v_span(vp)
  ops = tiled(bf16, kp, r, sub, vp)  # One swizzle for every wgmma operand (A and B share it).
  rk = lambda: smem((r, kp), bf16, transforms=ops)
  rr = lambda: smem((r, r), bf16, transforms=ops)
  rv = lambda n: smem((n, r, sub), bf16, transforms=ops)
  loop = dict(v=rv(slots), beta=rv(slots), dout=rv(slots),
              n=smem((slots, g, sub, kp), bf16, transforms=ops),
              y=rv(1), dz=rv(1), dr=rv(g), dav=rv(1),  # dz and dav stage dv and dbeta.
              dn=smem((sub, kp), f32, transforms=tiled(f32, kp)))
  if with_var:
    loop["dvar"] = smem((slots, r, sub), f32, transforms=tiled(f32, sub, vp))
  post = dict(ds=rr(), dak=rk(), dq=rk(), dk=rk(), dbk=smem((g, padded_width(kp)), f32))
  fixed = dict(q=rk(), qk=rk(), k=rk(), x=rk(), d=rr(), w=rr(), rows=smem((NUM_ROWS, r), f32),
               bk=smem((g, padded_width(kp)), f32), bv=smem((g, span), f32),
               dbv=smem((g, span), f32), drows=smem((NUM_DROWS, r), f32))
  scratch = list(fixed.values()) + [
      plgpu.RefUnion(loop, post), plgpu.Barrier(num_arrivals=5),
      plgpu.Barrier(num_arrivals=3 + g + int(with_var), num_barriers=slots)]

  def unpack(refs):
    named = dict(zip(fixed, refs[:len(fixed)]))
    union, setup_bar, ring_bars = refs[len(fixed):]
    loop_refs, post_refs = union
    return _Smem(**named, loop=loop_refs, post=post_refs), setup_bar, ring_bars

  return scratch, unpack


def smem_bytes(t: BackwardTiles, kp: int, vp: int, with_var: bool) -> int:
  """Shared memory of one CTA: the fixed buffers and the larger member of the union."""
  scratch, _ = _scratch(t, kp, vp, with_var)
  fixed, union = scratch[:-3], scratch[-3]
  return smem_bytes_of(fixed) + max(smem_bytes_of(jax.tree.leaves(member))
                                    for member in union.refs)


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
  """One CTA: the backward of the reads of one (batch*head n, group of chunks).

  refs: q, k [B, Tp, H, Kp]; v, beta, dout [B, Tp, H, Vp]; dvar [B, Tp, H, Vp] (with the
  variance); rows [BH, NB, NUM_ROWS, R]; bk [BH, NC, KW]; bv [BH, NC, span]; n [BH, NC, Vp,
  Kp]; then the outputs dq, dk [B, Tp, H, Kp], dv, dbeta [B, Tp, H, Vp] (bfloat16),
  drows [BH, NB, NUM_DROWS, R], dbk [BH, NC, KW], dbv [BH, NC, span], dn [BH, NC, Vp,
  Kp] (float32); then the scratch of `_scratch`.
  """
  n_in = 10 if with_var else 9
  ins, outs, scratch = refs[:n_in], refs[n_in:n_in + 8], refs[n_in + 8:]
  if with_var:
    q_g, k_g, v_g, beta_g, dout_g, dvar_g, rows_g, bk_g, bv_g, n_g = ins
  else:
    (q_g, k_g, v_g, beta_g, dout_g, rows_g, bk_g, bv_g, n_g), dvar_g = ins, None
  dq_g, dk_g, dv_g, dbeta_g, drows_g, dbk_g, dbv_g, dn_g = outs
  s, setup_bar, ring_bars = unpack(scratch)
  lp, post = s.loop, s.post
  r, g, sub, slots = t.rows, t.groups, t.sub, t.slots
  kp = s.k.shape[-1]
  blk, n = jax.lax.axis_index("b"), jax.lax.axis_index("n")
  batch, head = n // heads, n % heads
  steps, chunks = pl.ds(blk * r, r), pl.ds(blk * g, g)
  cols = [pl.ds(j * sub, sub) for j in range(num_sub)]

  plgpu.copy_gmem_to_smem(q_g.at[batch, steps, head], s.q, setup_bar)
  plgpu.copy_gmem_to_smem(k_g.at[batch, steps, head], s.k, setup_bar)
  plgpu.copy_gmem_to_smem(rows_g.at[n, blk], s.rows, setup_bar)
  plgpu.copy_gmem_to_smem(bk_g.at[n, chunks], s.bk, setup_bar)
  plgpu.copy_gmem_to_smem(bv_g.at[n, chunks], s.bv, setup_bar)

  def fetch(j):  # Sub-tile j's rows into slot j % slots.
    slot, bar = j % slots, ring_bars.at[j % slots]
    rows_of = lambda x_g: x_g.at[batch, steps, head, cols[j]]
    plgpu.copy_gmem_to_smem(rows_of(v_g), lp["v"].at[slot], bar)
    plgpu.copy_gmem_to_smem(rows_of(beta_g), lp["beta"].at[slot], bar)
    plgpu.copy_gmem_to_smem(rows_of(dout_g), lp["dout"].at[slot], bar)
    if with_var:
      plgpu.copy_gmem_to_smem(rows_of(dvar_g), lp["dvar"].at[slot], bar)
    for c in range(g):  # One chunk per copy: a TMA box has at most 5 dimensions.
      plgpu.copy_gmem_to_smem(n_g.at[n, blk * g + c, cols[j]], lp["n"].at[slot, c], bar)

  for j in range(min(slots, num_sub)):
    fetch(j)
  plgpu.barrier_wait(setup_bar)

  row = lambda i: plgpu.load(s.rows.at[i], layout=ROW)
  over_k = lambda x: jax.lax.broadcast_in_dim(x, (r, kp), (0,))
  over_v = lambda x: jax.lax.broadcast_in_dim(x, (r, sub), (0,))
  f, cs, ip, mb = row(ROW_F), row(ROW_CS), row(ROW_IP), row(ROW_MB)
  zeros = lambda shape: plgpu.layout_cast(jnp.zeros(shape, f32), WGMMA)
  row_zeros = lambda: plgpu.layout_cast(jnp.zeros((r,), f32), ROW)

  def col_sums(x, width):
    """The sums over each chunk's rows of x [R, width]: G COL vectors."""
    if g == 1:
      return [jnp.sum(x, axis=0)]
    return [jnp.sum(jnp.where(chunk_mask(r, width, chunk, c), x, 0.0), axis=0)
            for c in range(g)]

  def forward_part():
    """The forward's V-independent part (reads_forward.py): (k, k^2, mk, ibk, q, qk)."""
    k = plgpu.load(s.k, layout=WGMMA).astype(f32)
    ksq = k * k
    mk = jnp.sum(ksq, axis=1) * (1.0 / k_true)
    ak = matmul(s.d, s.x, (r, kp))
    bk = per_chunk_rows(lambda c: plgpu.load(s.bk.at[c, pl.ds(0, kp)], layout=COL), r,
                        chunk, g, kp)
    ibk = over_k(f) * bk + ak + over_k(ip)
    q = plgpu.load(s.q, layout=WGMMA).astype(f32)
    return k, ksq, mk, bk, ibk, q, q / ibk

  # D and X first (the products of forward_part read them), then the rest of the forward.
  k = plgpu.load(s.k, layout=WGMMA).astype(f32)
  s.x[...] = (k * k * over_k(mb)).astype(bf16)
  s.d[...] = decay_matrix(s.rows, r).astype(bf16)
  plgpu.commit_smem()
  _, _, mk, _, ibk, q, qk = forward_part()
  ibs = (jnp.sum(ibk, axis=1) - (kp - k_true) * ip) * (1.0 / k_true)
  sigma = jnp.sum(q * qk, axis=1) if with_var else None
  s.qk[...] = qk.astype(bf16)
  plgpu.commit_smem()
  scores = matmul(s.qk, s.k.transpose((1, 0)), (r, r))
  s.w[...] = (scores * decay_matrix(s.rows, r)).astype(bf16)
  plgpu.commit_smem()

  # Running sums over the sub-tiles: dW, the products dAv @ Y^T (part of dD) and dR @ N
  # (part of dqk), and per-step rows.
  d_w, d_dv, d_qc = zeros((r, r)), zeros((r, r)), zeros((r, kp))
  d_sigma, d_ibs, d_cs, d_f, d_ip, d_mk = (row_zeros() for _ in range(6))

  for j in range(num_sub):
    slot = j % slots
    plgpu.barrier_wait(ring_bars.at[slot])
    beta = plgpu.load(lp["beta"].at[slot], layout=WGMMA).astype(f32)
    lp["y"][0] = (beta * over_v(mk)).astype(bf16)
    plgpu.commit_smem()

    def reads(acc_v, acc_own, slot=slot):
      plgpu.wgmma(acc_v, s.d, lp["y"].at[0])
      plgpu.wgmma(acc_own, s.w, lp["v"].at[slot])
      return acc_v[...], acc_own[...]

    av, own = pl.run_scoped(reads, *[plgpu.ACC((r, sub), f32)] * 2)
    rc = carried_read(s.qk, lp["n"].at[slot], r, sub, chunk)
    bv = per_chunk_rows(lambda c, j=j: plgpu.load(s.bv.at[c, cols[j]], layout=COL), r, chunk,
                        g, sub)
    ibv = over_v(f) * bv + av + over_v(ip)
    vs = over_v(ibs) / ibv
    dout = plgpu.load(lp["dout"].at[slot], layout=WGMMA).astype(f32)
    dz = dout * vs
    dvs = dout * (own + over_v(cs) * rc)
    if with_var:
      dvar = plgpu.load(lp["dvar"].at[slot], layout=WGMMA)
      dvs = dvs + dvar * over_v(sigma)
      d_sigma = d_sigma + jnp.sum(dvar * vs, axis=1)
    dibv = -dvs * vs / ibv
    d_ibs = d_ibs + jnp.sum(dvs / ibv, axis=1)
    d_cs = d_cs + jnp.sum(dz * rc, axis=1)
    d_f = d_f + jnp.sum(dibv * bv, axis=1)
    d_ip = d_ip + jnp.sum(dibv, axis=1)
    for c, col in enumerate(col_sums(over_v(f) * dibv, sub)):
      s.dbv[c, cols[j]] = col
    dr = dz * over_v(cs)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # The last sub-tile's dv and dbeta.
    lp["dz"][0] = dz.astype(bf16)
    lp["dav"][0] = dibv.astype(bf16)
    for c in range(g):  # dR on the rows of chunk c (the carried read of chunk c's N).
      lp["dr"][c] = (dr if g == 1 else jnp.where(chunk_mask(r, sub, chunk, c), dr, 0.0)
                     ).astype(bf16)
    plgpu.commit_smem()

    def running(acc_w, acc_dd, acc_qc, slot=slot):
      plgpu.wgmma(acc_w, lp["dz"].at[0], lp["v"].at[slot].transpose((1, 0)))
      plgpu.wgmma(acc_dd, lp["dav"].at[0], lp["y"].at[0].transpose((1, 0)))
      for c in range(g):
        plgpu.wgmma(acc_qc, lp["dr"].at[c], lp["n"].at[slot, c])

    d_w, d_dv, d_qc = accumulate(running, (d_w, d_dv, d_qc), interpret)

    def row_grads(acc_dv, acc_dy):
      plgpu.wgmma(acc_dv, s.w.transpose((1, 0)), lp["dz"].at[0])
      plgpu.wgmma(acc_dy, s.d.transpose((1, 0)), lp["dav"].at[0])
      return acc_dv[...], acc_dy[...]

    dv, dy = pl.run_scoped(row_grads, *[plgpu.ACC((r, sub), f32)] * 2)
    beta = plgpu.load(lp["beta"].at[slot], layout=WGMMA).astype(f32)
    d_mk = d_mk + jnp.sum(dy * beta, axis=1)
    # dz and dav are free: the products above have read them.
    lp["dz"][0] = dv.astype(bf16)
    lp["dav"][0] = (dy * over_v(mk)).astype(bf16)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(lp["dz"].at[0], dv_g.at[batch, steps, head, cols[j]],
                            commit_group=False)
    plgpu.copy_smem_to_gmem(lp["dav"].at[0], dbeta_g.at[batch, steps, head, cols[j]],
                            commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    for c in range(g):  # dN of chunk c, [sub, Kp], through one staging buffer.
      dn = matmul(lp["dr"].at[c].transpose((1, 0)), s.qk, (sub, kp))
      if c:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      lp["dn"][...] = dn
      plgpu.commit_smem()  # After the last chunk's: every thread done with the slot.
      plgpu.copy_smem_to_gmem(lp["dn"], dn_g.at[n, blk * g + c, cols[j]])
    if j + slots < num_sub:
      fetch(j + slots)

  # After the loop: its buffers are free once the last copies out have read them.
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  k, ksq, _, bk, ibk, q, qk = forward_part()
  decay = decay_matrix(s.rows, r)
  scores = matmul(s.qk, s.k.transpose((1, 0)), (r, r))
  post["ds"][...] = (d_w * decay).astype(bf16)
  dd = d_dv + d_w * scores
  plgpu.commit_smem()

  def score_grads(acc_qk, acc_k):
    plgpu.wgmma(acc_qk, post["ds"], s.k)
    plgpu.wgmma(acc_k, post["ds"].transpose((1, 0)), s.qk)
    return acc_qk[...], acc_k[...]

  dqk, dk = pl.run_scoped(score_grads, *[plgpu.ACC((r, kp), f32)] * 2)
  dqk = dqk + d_qc
  if with_var:
    dqk = dqk + over_k(d_sigma) * q
  dq = dqk / ibk + (over_k(d_sigma) * qk if with_var else 0.0)
  true_k = plgpu.broadcasted_iota(jnp.int32, (r, kp), 1, layout=WGMMA) < k_true
  dibk = jnp.where(true_k, over_k(d_ibs) * (1.0 / k_true) - dqk * qk / ibk, 0.0)
  d_f = d_f + jnp.sum(dibk * bk, axis=1)
  d_ip = d_ip + jnp.sum(dibk, axis=1)
  for c, col in enumerate(col_sums(over_k(f) * dibk, kp)):
    post["dbk"][c, pl.ds(0, kp)] = col
  post["dak"][...] = dibk.astype(bf16)
  plgpu.commit_smem()

  def marginal_grads(acc_dd, acc_dx):
    plgpu.wgmma(acc_dd, post["dak"], s.x.transpose((1, 0)))
    plgpu.wgmma(acc_dx, s.d.transpose((1, 0)), post["dak"])
    return acc_dd[...], acc_dx[...]

  dd_k, dx = pl.run_scoped(marginal_grads, plgpu.ACC((r, r), f32), plgpu.ACC((r, kp), f32))
  dd = dd + dd_k
  dk = dk + 2.0 * k * (dx * over_k(mb) + over_k(d_mk) * (1.0 / k_true))
  p = dd * decay
  drows = {DROW_G_ROWS: jnp.sum(p, axis=1), DROW_F: d_f, DROW_CS: d_cs, DROW_IP: d_ip,
           DROW_MB: jnp.sum(dx * ksq, axis=1)}
  for i, vec in drows.items():
    s.drows[i] = vec
  s.drows[DROW_G_COLS] = jnp.sum(p, axis=0)
  post["dq"][...] = dq.astype(bf16)
  post["dk"][...] = dk.astype(bf16)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(post["dq"], dq_g.at[batch, steps, head], commit_group=False)
  plgpu.copy_smem_to_gmem(post["dk"], dk_g.at[batch, steps, head], commit_group=False)
  plgpu.copy_smem_to_gmem(s.drows, drows_g.at[n, blk], commit_group=False)
  plgpu.copy_smem_to_gmem(post["dbk"], dbk_g.at[n, chunks], commit_group=False)
  plgpu.copy_smem_to_gmem(s.dbv, dbv_g.at[n, chunks], commit_group=False)
  plgpu.commit_smem_to_gmem_group()
  plgpu.wait_smem_to_gmem(0)


def chunk_reads_backward(q, k, v, beta, rows, bk, bv, n_c, dout, dvar, *, heads: int,
                         chunk: int, k_true: int, tiles: BackwardTiles, interpret):
  """The cotangents of `reads_forward.chunk_reads_forward`'s inputs.

  Arguments as there (bv [BH, NC, tiles.v_span(Vp)]), and dout
  [B, Tp, H, Vp] (v's dtype), dvar [B, Tp, H, Vp] float32 or None (no variance).
  Returns dq, dk [B, Tp, H, Kp], dv, dbeta [B, Tp, H, Vp] (the rows' dtype), drows
  [BH, NB, NUM_DROWS, R], dbk [BH, NC, KW], dbv [BH, NC, span], dn [BH, NC, Vp, Kp]
  (float32).
  """
  b, tp, _, kp = q.shape
  vp = v.shape[-1]
  bh, nb = rows.shape[:2]
  with_var = dvar is not None
  scratch, unpack = _scratch(tiles, kp, vp, with_var)
  sds = jax.ShapeDtypeStruct
  out_type = [sds(q.shape, q.dtype), sds(k.shape, k.dtype), sds(v.shape, v.dtype),
              sds(beta.shape, beta.dtype), sds((bh, nb, NUM_DROWS, tiles.rows), f32),
              sds(bk.shape, f32), sds(bv.shape, f32), sds(n_c.shape, f32)]
  # No automatic barriers: rows arrive by TMA before their barrier waits; what threads
  # store for the tensor cores or a copy out is made visible by commit_smem first; a
  # ring slot is refilled after the commit_smem that follows its last reads; the loop's
  # buffers are reused after the loop only once its copies out have read them.
  kernel = mosaic_kernel(
      functools.partial(_kernel, heads=heads, chunk=chunk, k_true=k_true, with_var=with_var,
                        num_sub=tiles.num_sub(vp), t=tiles, unpack=unpack,
                        interpret=bool(interpret)),
      out_type=out_type, scratch_types=scratch, grid=(nb, bh), grid_names=("b", "n"),
      interpret=interpret, name="fast_palimpsa_reads_backward")
  ins = (q, k, v, beta, dout) + ((dvar,) if with_var else ()) + (rows, bk, bv, n_c)
  return tuple(kernel(*ins))
