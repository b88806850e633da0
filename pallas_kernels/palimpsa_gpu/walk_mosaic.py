"""The backward chunk walk as a Pallas Mosaic GPU kernel (Hopper and newer).

Same outputs as `walk.walk_backward` with [16, 16] state tiles (one V-tile of 16 rows and
one K-slice of 16 columns per walk, sub-chunks of `sub` steps). What differs is where
the data lives:

- A CTA is one warpgroup; warp w walks chunk 4g + w, so the CTA holds its state and
  adjoints as [4, 16, 16] arrays in a layout that gives each warp its own [16, 16] tile
  (`TILE_PER_WARP`), and every per-step sum is a warp-shuffle reduction inside a warp.
- The four chunks' rows come into shared memory by TMA up front (in quarters, each with
  its barrier, so the checkpoint pass starts on the first quarter); the sub-chunk
  checkpoints stay in shared memory; outputs are staged per sub-chunk in shared memory
  and written by TMA. No register ever waits on global memory inside the walk.

Inputs are rearranged by XLA so that each TMA copy is one box: rows
[BH, T, n*16] -> [BH, G, n, chunk, 4, 16] (G groups of 4 chunks, n K-slices or V-tiles).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

TILE = 16  # V-rows and K-columns of one walk's state tile.
WALKS = 4  # Walks per warpgroup: one per warp.
# [4, 16, 16] arrays, warp w holding [w]: each lane 8 entries (2 V-rows x 4 K-columns).
TILE_PER_WARP = plgpu.Layout.TILED(
    plgpu.Tiling(((WALKS, TILE, 8), (8, 8), (2,))), warp_dims=(-6,), lane_dims=(-3, -2),
    vector_dim=-1)
K_ROWS = TILE_PER_WARP.reduce(1)  # [4, 16] (walk, k): a k-indexed row per warp.
V_ROWS = TILE_PER_WARP.reduce(2)  # [4, 16] (walk, v): a v-indexed row per warp.
# Dynamic shared memory per CTA on sm_90, and what Pallas reserves besides our scratch
# (reduction scratch, barriers, alignment).
SMEM_LIMIT = 227 * 1024
_SMEM_RESERVED = 3 * 1024

f32 = jnp.float32


def _smem_scratch(chunk: int, sub: int, row_dtypes) -> list:
  """The kernel's shared memory, in `_kernel`'s order: one [chunk, 4, 16] slot per row
  input (row_dtypes: k, q, v, beta, dO[, dvar]) and for the gates; the prior precision
  row; the start states; the checkpoints of M and Ibar; two staging slots each for dq,
  dk, dv, dbeta; the per-step sums."""
  smem = plgpu.SMEM
  tile = (WALKS, TILE, TILE)
  return ([smem((chunk, WALKS, TILE), d) for d in row_dtypes]
          + [smem((chunk, WALKS, TILE), f32), smem((WALKS, TILE), f32), smem(tile, f32),
             smem(tile, f32), smem((chunk // sub,) + tile, f32),
             smem((chunk // sub,) + tile, f32)]
          + [smem((2, sub, WALKS, TILE), f32)] * 4 + [smem((chunk, WALKS), f32)])


def smem_bytes(chunk: int, sub: int, row_dtypes) -> int:
  """Shared memory of one CTA (row_dtypes as in `_smem_scratch`)."""
  return sum(math.prod(ref.shape) * jnp.dtype(ref.dtype).itemsize
             for ref in _smem_scratch(chunk, sub, row_dtypes)) + _SMEM_RESERVED


def supported(chunk: int, sub: int, row_dtypes, *, interpret: bool) -> bool:
  """Whether the chunk cuts into quarters of whole sub-chunks and, compiled, the CTA
  fits in shared memory (bfloat16 or float16 rows; float32 rows do not fit)."""
  quarter = chunk // 4
  return (chunk % 4 == 0 and quarter % sub == 0
          and (interpret or smem_bytes(chunk, sub, row_dtypes) <= SMEM_LIMIT))


def _pointwise_ops(interpret: bool):
  """fma(x, y, z) and reciprocal(x) on [4, 16, 16] tiles: PTX fma.rn.f32 and
  rcp.approx.ftz.f32 (<= 1 ulp), as in the Triton kernels; plain jnp in interpret mode."""
  if interpret:
    return (lambda x, y, z: x * y + z), (lambda x: 1.0 / x)
  # Pallas Mosaic GPU has no FMA or approximate-reciprocal primitive in jax 0.11.2; these
  # are FragmentedArray's private helpers for one PTX instruction per element.
  instr = mgpu.FragmentedArray._lift_fast_instr
  tile = plgpu.ShapeDtypeStruct((WALKS, TILE, TILE), f32, layout=TILE_PER_WARP)

  @plgpu.inline_mgpu(arg_types=(TILE_PER_WARP,) * 3, return_type=tile)
  def fma(_, x, y, z):
    return x._pointwise(instr("fma.rn.f32"), y, z)

  @plgpu.inline_mgpu(arg_types=(TILE_PER_WARP,), return_type=tile)
  def reciprocal(_, x):
    return x._pointwise(instr("rcp.approx.ftz.f32"))

  return fma, reciprocal


def _over_k(x):
  """A [4, 16] k-row per walk, broadcast over the tile's V-rows."""
  return plgpu.layout_cast(
      jax.lax.broadcast_in_dim(x, (WALKS, TILE, TILE), (0, 2)), TILE_PER_WARP)


def _over_v(x):
  """A [4, 16] v-row per walk, broadcast over the tile's K-columns."""
  return plgpu.layout_cast(
      jax.lax.broadcast_in_dim(x, (WALKS, TILE, TILE), (0, 1)), TILE_PER_WARP)


def _kernel(*refs, chunk, sub, num_k, with_var, interpret):
  """One CTA: 4 chunks (one per warp) of one batch*head, V-tile and K-slice."""
  n_in = 10 if with_var else 9
  ins, outs, scratch = refs[:n_in], refs[n_in:n_in + 7], refs[n_in + 7:]
  k_g, q_g, v_g, beta_g, do_g = ins[:5]
  dvar_g = ins[5] if with_var else None
  a_g, ip_g, m0_g, b0_g = ins[-4:]
  dq_g, dk_g, dv_g, dbeta_g, s_g, am_g, ab_g = outs
  row_smem, (a_s, ip_s, m0_s, b0_s, ckpt_m, ckpt_b, dq_o, dk_o, dv_o, dbeta_o, s_o,
             row_bars, start_bar) = scratch[:n_in - 4], scratch[n_in - 4:]
  k_s, q_s, v_s, beta_s, do_s = row_smem[:5]
  dvar_s = row_smem[5] if with_var else None
  fma, reciprocal = _pointwise_ops(interpret)
  n_sub, quarter = chunk // sub, chunk // 4

  p, g, n = (jax.lax.axis_index(name) for name in ("p", "g", "n"))
  vt, ks = p // num_k, p % num_k
  for src, dst in ((ip_g.at[n, ks], ip_s), (m0_g.at[n, g, vt, ks], m0_s),
                   (b0_g.at[n, g, vt, ks], b0_s)):
    plgpu.copy_gmem_to_smem(src, dst, start_bar)
  row_pairs = [(k_g.at[n, g, ks], k_s), (q_g.at[n, g, ks], q_s)] + [
      (x.at[n, g, vt], s) for x, s in ((v_g, v_s), (beta_g, beta_s), (do_g, do_s))]
  if with_var:
    row_pairs.append((dvar_g.at[n, g, vt], dvar_s))
  row_pairs.append((a_g.at[n, g], a_s))
  for i in range(4):
    steps = pl.ds(i * quarter, quarter)
    for src, dst in row_pairs:
      plgpu.copy_gmem_to_smem(src.at[steps], dst.at[steps], row_bars.at[i])
  plgpu.barrier_wait(start_bar)

  def load(ref, t, layout):
    return plgpu.load(ref.at[t], layout=layout).astype(f32)

  def write_rows(t):  # What the state update at step t needs.
    k = _over_k(load(k_s, t, K_ROWS))
    return (k, _over_v(load(v_s, t, V_ROWS)), _over_v(load(beta_s, t, V_ROWS)),
            _over_v(load(a_s, t, V_ROWS)))

  def advance(m, b, rows):
    k, v, beta, a = rows
    return fma(a, m, v * k), fma(a, b, beta * (k * k))

  def checkpoints(j, carry):  # States before every sub-chunk, into shared memory.
    m, b = carry
    for i in range(4):
      @pl.when(j == i * (quarter // sub))
      def _():
        plgpu.barrier_wait(row_bars.at[i])
    ckpt_m[j] = m
    ckpt_b[j] = b
    for s in range(sub):
      m, b = advance(m, b, write_rows(j * sub + s))
    return m, b

  m0 = plgpu.load(m0_s, layout=TILE_PER_WARP)
  b0 = plgpu.load(b0_s, layout=TILE_PER_WARP)
  ip = _over_k(plgpu.load(ip_s, layout=K_ROWS))
  jax.lax.fori_loop(0, n_sub, checkpoints, (m0, b0))

  def reverse(i, carry):
    # gm, gb: adjoints of step t0 + sub (not yet decayed by its gate a_next).
    gm, gb, a_next = carry
    j = n_sub - 1 - i
    slot = i % 2
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # The slot's copies of 2 bodies ago.
    m = plgpu.load(ckpt_m.at[j], layout=TILE_PER_WARP)
    b = plgpu.load(ckpt_b.at[j], layout=TILE_PER_WARP)
    rows, states = [], []
    for s in range(sub):  # Recompute the sub-chunk's states, kept in registers.
      rows.append(write_rows(j * sub + s))
      m, b = advance(m, b, rows[-1])
      states.append((m, b))
    for s in reversed(range(sub)):
      t = j * sub + s
      k, v, beta, a = rows[s]
      m, b = states[s]
      q = _over_k(load(q_s, t, K_ROWS))
      do = _over_v(load(do_s, t, V_ROWS))
      # out = sum_k mu q with mu = m r, r = 1 / (b + Ip): dL/dm = do q r and
      # dL/db = -(do q r) mu (+ the variance's -dvar (q r)^2).
      r = reciprocal(b + ip)
      mu = m * r
      dm = (do * q) * r
      dq_terms = do * mu
      di = -(dm * mu)
      if with_var:
        dvar = _over_v(load(dvar_s, t, V_ROWS))
        qr = q * r
        dq_terms = fma(2.0 * dvar, qr, dq_terms)
        di = fma(-dvar, qr * qr, di)
      gm = fma(a_next, gm, dm)
      gb = fma(a_next, gb, di)
      dq_o[slot, s] = jnp.sum(dq_terms, axis=1)
      dk_o[slot, s] = jnp.sum(fma(gm, v, (gb * (2.0 * beta)) * k), axis=1)
      dv_o[slot, s] = jnp.sum(gm * k, axis=2)
      dbeta_o[slot, s] = jnp.sum(gb * (k * k), axis=2)
      s_o[t] = jnp.sum(jnp.sum(di, axis=2), axis=1)
      a_next = a
    plgpu.commit_smem()
    steps = pl.ds(j * sub, sub)
    plgpu.copy_smem_to_gmem(dq_o.at[slot], dq_g.at[vt, n, g, ks, steps], commit_group=False)
    plgpu.copy_smem_to_gmem(dk_o.at[slot], dk_g.at[vt, n, g, ks, steps], commit_group=False)
    plgpu.copy_smem_to_gmem(dv_o.at[slot], dv_g.at[ks, n, g, vt, steps], commit_group=False)
    plgpu.copy_smem_to_gmem(dbeta_o.at[slot], dbeta_g.at[ks, n, g, vt, steps])
    return gm, gb, a_next

  zero = plgpu.layout_cast(jnp.zeros((WALKS, TILE, TILE), f32), TILE_PER_WARP)
  gm, gb, a_first = jax.lax.fori_loop(0, n_sub, reverse, (zero, zero, zero))
  m0_s[...] = a_first * gm  # The start-state buffers now hold the adjoints.
  b0_s[...] = a_first * gb
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(s_o, s_g.at[ks, vt, n, g], commit_group=False)
  plgpu.copy_smem_to_gmem(m0_s, am_g.at[n, g, vt, ks], commit_group=False)
  plgpu.copy_smem_to_gmem(b0_s, ab_g.at[n, g, vt, ks])
  plgpu.wait_smem_to_gmem(0)


def _rows(x: jax.Array, groups: int, chunk: int) -> jax.Array:
  """[BH, Tp, n*16] -> [BH, G, n, chunk, 4, 16] (chunks past Tp are zero)."""
  bh, tp, width = x.shape
  x = jnp.pad(x, ((0, 0), (0, groups * WALKS * chunk - tp), (0, 0)))
  x = x.reshape(bh, groups, WALKS, chunk, width // TILE, TILE)
  return jnp.transpose(x, (0, 1, 4, 3, 2, 5))


def _gates(a: jax.Array, groups: int, chunk: int) -> jax.Array:
  """[BH, Tp] -> [BH, G, chunk, 4, 16] float32, each gate repeated over 16 V-rows."""
  bh, tp = a.shape
  a = jnp.pad(a.astype(f32), ((0, 0), (0, groups * WALKS * chunk - tp)))
  a = jnp.transpose(a.reshape(bh, groups, WALKS, chunk), (0, 1, 3, 2))
  return jnp.broadcast_to(a[..., None], a.shape + (TILE,))


def _states(x: jax.Array, groups: int) -> jax.Array:
  """[BH, NC, Vp, Kp] -> [BH, G, NV, NK, 4, 16, 16] (chunks past NC are zero)."""
  bh, nc, vp, kp = x.shape
  x = jnp.pad(x, ((0, 0), (0, groups * WALKS - nc), (0, 0), (0, 0)))
  x = x.reshape(bh, groups, WALKS, vp // TILE, TILE, kp // TILE, TILE)
  return jnp.transpose(x, (0, 1, 3, 5, 2, 4, 6))


def _rows_back(x: jax.Array, tp: int) -> jax.Array:
  """[P, BH, G, n, chunk, 4, 16] -> [P, BH, Tp, n*16]."""
  p, bh, groups, n, chunk = x.shape[:5]
  x = jnp.transpose(x, (0, 1, 2, 5, 4, 3, 6))
  return x.reshape(p, bh, groups * WALKS * chunk, n * TILE)[:, :, :tp]


def _states_back(x: jax.Array, nc: int) -> jax.Array:
  """[BH, G, NV, NK, 4, 16, 16] -> [BH, NC, Vp, Kp]."""
  bh, groups, nv, nk = x.shape[:4]
  x = jnp.transpose(x, (0, 1, 4, 2, 5, 3, 6))
  return x.reshape(bh, groups * WALKS, nv * TILE, nk * TILE)[:, :nc]


def walk_backward(q, k, v, beta, a, ip_row, do, dvar, m_starts, b_starts, *, chunk: int,
                  sub: int, interpret: bool, bh_range: tuple[int, int] | None = None):
  """Reverse walk over all chunks, each with zero adjoint from later chunks.

  Args:
    q, k: [BH, Tp, Kp]; v, beta, do: [BH, Tp, Vp]; dvar: [BH, Tp, Vp] or None;
    a: [BH, Tp] step gates; ip_row: [BH, Kp]; m_starts, b_starts: [BH, NC, Vp, Kp].
    Kp and Vp are multiples of 16, Tp of chunk; `supported(chunk, sub, ...)` holds.
    bh_range: (first, count): walk only these batch*heads.

  Returns:
    As `walk.walk_backward` with groups = Vp / 16 and k_split = Kp / 16: dq, dk
    [Vp/16, BH, Tp, Kp]; dv, dbeta [Kp/16, BH, Tp, Vp]; s [Kp/16, Vp/16, BH, Tp];
    adj_m, adj_b [BH, NC, Vp, Kp].
  """
  first, count = bh_range or (0, q.shape[0])
  pick = lambda x: jax.lax.slice_in_dim(x, first, first + count)
  bh, (_, tp, kp), vp = count, q.shape, v.shape[-1]
  nc = tp // chunk
  groups = -(-nc // WALKS)
  nk, nv = kp // TILE, vp // TILE
  with_var = dvar is not None
  row_dtypes = [x.dtype for x in (k, q, v, beta, do) + ((dvar,) if with_var else ())]
  if not supported(chunk, sub, row_dtypes, interpret=interpret):
    raise ValueError(f"chunk={chunk}, sub={sub} with rows of "
                     f"{[jnp.dtype(d).name for d in row_dtypes]} do not fit the kernel")
  rows = lambda x: _rows(pick(x), groups, chunk)
  ins = [rows(k), rows(q), rows(v), rows(beta), rows(do)]
  if with_var:
    ins.append(rows(dvar))
  ins += [_gates(pick(a), groups, chunk),
          jnp.broadcast_to(pick(ip_row).reshape(bh, nk, 1, TILE), (bh, nk, WALKS, TILE)),
          _states(pick(m_starts), groups), _states(pick(b_starts), groups)]
  sds = jax.ShapeDtypeStruct
  out_type = ([sds((nv, bh, groups, nk, chunk, WALKS, TILE), f32)] * 2
              + [sds((nk, bh, groups, nv, chunk, WALKS, TILE), f32)] * 2
              + [sds((nk, nv, bh, groups, chunk, WALKS), f32)]
              + [sds((bh, groups, nv, nk, WALKS, TILE, TILE), f32)] * 2)
  scratch = _smem_scratch(chunk, sub, row_dtypes) + [
      plgpu.Barrier(num_arrivals=len(row_dtypes) + 1, num_barriers=4),
      plgpu.Barrier(num_arrivals=3)]
  kernel = plgpu.kernel(
      functools.partial(_kernel, chunk=chunk, sub=sub, num_k=nk, with_var=with_var,
                        interpret=interpret),
      out_type=out_type, scratch_types=scratch, grid=(nv * nk, groups, bh),
      grid_names=("p", "g", "n"),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Lane,
          # Every thread reads back only what it wrote itself, or what a TMA copy
          # brought in after a barrier; stores leave through commit_smem.
          unsafe_no_auto_barriers=True),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
      kernel_name="palimpsa_walk_backward_mosaic")
  dq, dk, dv, dbeta, s, adj_m, adj_b = kernel(*ins)
  s = jnp.transpose(s, (0, 1, 2, 3, 5, 4)).reshape(nk, nv, bh, groups * WALKS * chunk)
  return (_rows_back(dq, tp), _rows_back(dk, tp), _rows_back(dv, tp),
          _rows_back(dbeta, tp), s[..., :tp], _states_back(adj_m, nc),
          _states_back(adj_b, nc))
