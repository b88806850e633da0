"""The backward chunk walk as a Pallas (Triton) kernel.

Grid (B*H, chunk, V-tile group, K-slice); each program loops over its V-tiles (usually one)
on its K-slice (usually 16 columns), recomputes the states of its chunk sub-chunk by
sub-chunk (sub-chunk start states go through a per-program scratch output; a sub-chunk's rows
are loaded once, optionally a body ahead, for its recompute and its reverse steps), and walks
them in reverse. dq and dk are partial sums over the V-tile groups, dv, dbeta and the dL/dI
sums partial over the K-slices. The state and adjoints are held as K-parts ([BV, k_part]
tensors: Triton shapes are powers of two) and their updates are written as explicit FMAs.
The rows are read in the caller's layout [B, Tp, H, D] (`layout.rows_spec`).
"""

import dataclasses
import functools
import operator
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.common import fast_reciprocal, fma, k_parts, round_up
from pallas_kernels.palimpsa_gpu import layout
from pallas_kernels.palimpsa_gpu.config import GpuKernelConfig, StageCall, largest_block_v
from pallas_kernels.palimpsa_gpu.launch_triton import triton_params


def supports(call: StageCall) -> str | None:
  """None: it runs every call the op takes (K, V <= 256, any dtypes, any device)."""
  del call


@dataclasses.dataclass(frozen=True)
class WalkBackwardTritonTiles:
  """Grid (batch*head, chunk, group, K-slice): each program walks its V-tiles of block_v rows
  (groups programs over V) on one of k_split K-slices, held as K-parts of k_part columns
  (their dv, dbeta and dL/dI sums partial over the slices, summed by XLA); sub steps per
  sub-chunk (states recomputed together), num_warps warps; prefetch: each reverse body loads
  the next sub-chunk's rows first. K is padded to a multiple of k_part * k_split (one part
  over all of K when k_part is a power of two >= K)."""

  backend: ClassVar[str] = "triton"
  k_part: int
  k_split: int
  block_v: int
  groups: int
  sub: int
  num_warps: int
  prefetch: bool

  def k_width(self, kp: int) -> int:
    """K width of the walk, for K padded to kp."""
    return round_up(kp, self.k_part * self.k_split)

  def starts_k_width(self, kp: int, kb: int) -> int:
    """K width to give the walk the boundary states at, from their width kb >= kp (zero
    past K): a walk in one K-part reads the columns past theirs up to its own width as
    zeros, so states no wider than that stay as they are (no copy); K-parts or K-slices
    need k_width."""
    width = self.k_width(kp)
    return kb if self.k_part == width and kb <= width else width


def tiles(call: StageCall) -> WalkBackwardTritonTiles:
  """The tiles the sweeps of benchmarks/op/tuning.py --op palimpsa chose: single-warp
  programs over one [16, 16] state tile each (K cut into 16-column slices, no padding),
  sub-chunks of 4 steps, the next sub-chunk's rows loaded a body ahead; at K=16, one program
  over K in 8-column parts and V-tiles of up to 512 entries."""
  if call.kp == 16:
    parts = dict(k_part=8, k_split=1, block_v=largest_block_v(call.vp, 16, 512), groups=1)
  else:
    parts = dict(k_part=16, k_split=call.kp // 16, block_v=16, groups=call.vp // 16)
  return WalkBackwardTritonTiles(**parts, sub=4, num_warps=1, prefetch=call.kp > 16)


def temp_bytes(cfg: GpuKernelConfig) -> int:
  """Bytes of scratch and partial sums per batch*head of one call."""
  own = cfg.walk_bwd
  tp, vp, kp = cfg.t + cfg.t_pad, cfg.v + cfg.v_pad, cfg.k_bwd
  scratch = tp // own.sub * own.groups * own.block_v * kp * 2
  partials = (own.groups * kp * 2 + own.k_split * vp * 2 + 1) * tp
  return 4 * (scratch + partials)


def _barrier(interpret: bool):
  """Orders a program's global-memory writes before its later reads (GPU only)."""
  if not interpret:
    plgpu_triton.debug_barrier()


def _total(xs: list[jax.Array]) -> jax.Array:
  """Sum of a list of arrays (the K-parts' reductions)."""
  return functools.reduce(operator.add, xs)


def _plus(acc: jax.Array | None, x: jax.Array) -> jax.Array:
  """acc + x, or x where there is nothing to accumulate onto."""
  return x if acc is None else acc + x


def _backward_kernel(q_ref, k_ref, v_ref, beta_ref, a_ref, ip_ref, do_ref, dvar_ref,
                     m0_ref, b0_ref, dq_ref, dk_ref, dv_ref, dbeta_ref, s_ref,
                     am_ref, ab_ref, sm_ref, sb_ref, *, chunk, sub, block_v, k_part,
                     k_width, num_tiles, prefetch, with_var, interpret):
  """Reverse walk of one chunk (one group of V-tiles, one K-slice), zero adjoint from
  later chunks.

  The program's states and adjoints [BV, k_width] (its K-slice of Kp, columns from
  program_id(3) * k_width) are held as K-parts ([BV, k_part] each).
  """
  k_first = pl.multiple_of(pl.program_id(3) * k_width, k_width)
  parts = [pl.ds(k_first + p.start, p.size) for p in k_parts(k_width, k_part)]
  ips = [ip_ref[p].astype(jnp.float32)[None, :] for p in parts]
  n_sub = chunk // sub
  # With several V-tiles per program, dq, dk and s accumulate over them in the output
  # block (zeroed here); with one, each step's sums are written once.
  accumulate = num_tiles > 1
  if accumulate:
    for p in parts:
      dq_ref[:, p] = jnp.zeros((chunk, k_part), jnp.float32)
      dk_ref[:, p] = jnp.zeros((chunk, k_part), jnp.float32)
    s_ref[...] = jnp.zeros((chunk,), jnp.float32)

  first_tile = pl.program_id(2) * num_tiles

  def tile(i, _):
    vt = first_tile + i
    cols = pl.ds(pl.multiple_of(vt * block_v, block_v), block_v)

    def load_rows(t):
      return ([k_ref[t, p].astype(jnp.float32)[None, :] for p in parts],
              v_ref[t, cols].astype(jnp.float32)[:, None],
              beta_ref[t, cols].astype(jnp.float32)[:, None], a_ref[t])

    def advance(ms, bs, row):
      ks, v, beta, a = row
      return ([fma(a, m, v * k, interpret=interpret) for m, k in zip(ms, ks)],
              [fma(a, b, beta * (k * k), interpret=interpret) for b, k in zip(bs, ks)])

    local = k_parts(k_width, k_part)  # The parts' columns in the scratch.

    def forward(j, carry):  # States before every sub-chunk, into the scratch.
      ms, bs = carry
      for p, m, b in zip(local, ms, bs):
        sm_ref[j, :, p] = m
        sb_ref[j, :, p] = b
      for s in range(sub):
        ms, bs = advance(ms, bs, load_rows(j * sub + s))
      return ms, bs

    def start_state(ref, p):
      """ref[cols, p], zero in the columns past the start states' width."""
      width = ref.shape[-1]
      if width == k_ref.shape[-1]:
        return ref[cols, p]
      if len(parts) > 1 or k_width != k_ref.shape[-1]:
        # Pallas masks a slice past the end only from column 0.
        raise ValueError(f"K-parts or K-slices need the states at the walk's width "
                         f"{k_ref.shape[-1]}, got {width}")
      inside = jax.lax.broadcasted_iota(jnp.int32, (1, p.size), 1) < width
      return plgpu_triton.load(ref.at[cols, p], mask=inside, other=0.0)

    jax.lax.fori_loop(0, n_sub, forward, (
        [start_state(m0_ref, p) for p in parts],
        [start_state(b0_ref, p) for p in parts]))
    _barrier(interpret)

    def load_sub_chunk(j):
      """Sub-chunk j's start state and rows, loaded once for the recompute and the
      reverse steps."""
      t0 = j * sub
      return ([sm_ref[j, :, p] for p in local], [sb_ref[j, :, p] for p in local],
              [load_rows(t0 + s) for s in range(sub)],
              [[q_ref[t0 + s, p].astype(jnp.float32)[None, :] for p in parts]
               for s in range(sub)],
              [do_ref[t0 + s, cols].astype(jnp.float32)[:, None] for s in range(sub)])

    def backward(i, carry):
      # gms, gbs: adjoints of step t0 + sub (not yet decayed by its gate a_next).
      gms, gbs, a_next, loaded = carry
      j = n_sub - 1 - i
      t0 = j * sub
      if prefetch:  # This sub-chunk's loads were issued in the previous body.
        ms, bs, rows, qs, dos = loaded
        loaded = load_sub_chunk(jnp.maximum(j - 1, 0))
      else:
        ms, bs, rows, qs, dos = load_sub_chunk(j)
      states = []
      for s in range(sub):  # Recompute the sub-chunk's states, kept in registers.
        ms, bs = advance(ms, bs, rows[s])
        states.append((ms, bs))
      # Earlier V-tiles' sums, loaded up front so their latency is paid once.
      if accumulate:
        acc = [([dq_ref[t0 + s, p] for p in parts], [dk_ref[t0 + s, p] for p in parts],
                s_ref[t0 + s]) for s in range(sub)]
      else:
        acc = [([None] * len(parts), [None] * len(parts), None)] * sub
      for s in reversed(range(sub)):
        t = t0 + s
        ks, v, beta, a = rows[s]
        ms, bs = states[s]
        do = dos[s]
        dvar = dvar_ref[t, cols].astype(jnp.float32)[:, None] if with_var else None
        dv, dbeta, ds = [], [], []
        for n, p in enumerate(parts):
          q, k, m, b = qs[s][n], ks[n], ms[n], bs[n]
          # out = sum_k mu q with mu = m r, r = 1 / (b + Ip): dL/dm = do q r and
          # dL/db = -(do q r) mu (+ the variance's -dvar (q r)^2).
          r = fast_reciprocal(b + ips[n], interpret=interpret)
          mu = m * r
          dm = (do * q) * r
          dq_terms = do * mu
          di = -(dm * mu)
          if with_var:
            qr = q * r
            dq_terms = fma(2.0 * dvar, qr, dq_terms, interpret=interpret)
            di = fma(-dvar, qr * qr, di, interpret=interpret)
          gm = fma(a_next, gms[n], dm, interpret=interpret)
          gb = fma(a_next, gbs[n], di, interpret=interpret)
          dq_ref[t, p] = _plus(acc[s][0][n], jnp.sum(dq_terms, axis=0))
          dk_ref[t, p] = _plus(acc[s][1][n], jnp.sum(
              fma(gm, v, (gb * (2.0 * beta)) * k, interpret=interpret), axis=0))
          dv.append(jnp.sum(gm * k, axis=1))
          dbeta.append(jnp.sum(gb * (k * k), axis=1))
          # Only sum_{v,k} dL/dI_t is needed. A [16, 16] tile holds 2 rows of 4
          # columns per lane: over K first is 2 shuffle rounds per row, then 3 for the
          # V row (7 in all; over V first, 12 + 2).
          ds.append(jnp.sum(jnp.sum(di, axis=1)))
          gms[n], gbs[n] = gm, gb
        a_next = a
        dv_ref[t, cols] = _total(dv)
        dbeta_ref[t, cols] = _total(dbeta)
        s_ref[t] = _plus(acc[s][2], _total(ds))
      return gms, gbs, a_next, loaded

    zeros = [jnp.zeros((block_v, k_part), jnp.float32) for _ in parts]
    loaded = load_sub_chunk(n_sub - 1) if prefetch else ()
    gms, gbs, a_first, _ = jax.lax.fori_loop(
        0, n_sub, backward, (zeros, list(zeros), jnp.float32(0.0), loaded))
    for p, gm, gb in zip(parts, gms, gbs):
      am_ref[cols, p] = a_first * gm
      ab_ref[cols, p] = a_first * gb
    _barrier(interpret)
    return 0

  _barrier(interpret)
  jax.lax.fori_loop(0, num_tiles, tile, 0)


def walk_backward(q, k, v, beta, a, ip_row, do, dvar, m_starts, b_starts, *, heads: int,
                  chunk: int, block_v: int, sub: int, groups: int, k_part: int,
                  k_split: int, num_warps: int, interpret: bool, prefetch: bool = False,
                  bh_range: tuple[int, int] | None = None):
  """Reverse walk over all chunks, each with zero adjoint from later chunks.

  Grid (B*H, chunk, group, K-slice): each program walks `Vp / block_v / groups` V-tiles
  in turn, over its `Kp / k_split` columns.

  Args:
    q, k: [B, Tp, H, Kp]; v, beta, do: [B, Tp, H, Vp]; dvar: [B, Tp, H, Vp] or None (the
    caller's layout, padded); a: [BH, Tp]; ip_row: [BH, Kp]; m_starts, b_starts:
    [BH, NC, Vp, Ks], Ks <= Kp
    (columns past Ks read as zero: the padding's states stay at the prior; Ks = Kp
    unless the walk is one K-part over all of Kp).
    k_part: width of the K-parts (a power of two dividing Kp / k_split).
    k_split: K-slices walked by separate programs (their dv, dbeta and s are partial
    sums over K, to be summed).
    prefetch: each reverse body loads the next sub-chunk's state and rows first.
    heads: H (batch*head n is batch n // H, head n % H).
    bh_range: (first, count): walk only these batch*heads (the outputs then have
      `count` in place of BH), so that a call's scratch and partial sums stay bounded.

  Returns:
    dq, dk [groups, BH, Tp, Kp] (to be summed over groups; dk without the later
    chunks' part); dv, dbeta [k_split, BH, Tp, Vp] (chunk-local parts, to be summed
    over K-slices); s [k_split, groups, BH, Tp] (sum_{v,k} dL/dI_t, chunk-local, to be
    summed over K-slices and groups); adj_m, adj_b [BH, NC, Vp, Kp]: each chunk's
    adjoint of the state before its first step.
  """
  _, tp, _, kp = q.shape
  first, bh = bh_range or (0, a.shape[0])
  vp = v.shape[-1]
  nc = tp // chunk
  num_tiles = vp // block_v
  if num_tiles % groups:
    raise ValueError(f"groups={groups} must divide the {num_tiles} V-tiles")
  if kp % (k_split * k_part):
    raise ValueError(f"k_split={k_split} slices of k_part={k_part} columns must divide "
                     f"K={kp}")
  k_width = kp // k_split
  with_var = dvar is not None
  row_k = layout.rows_spec(heads, chunk, kp, lambda n, c, g, s: (n + first, c, 0))
  row_v = layout.rows_spec(heads, chunk, vp, lambda n, c, g, s: (n + first, c, 0))
  part_k = pl.BlockSpec((None, None, chunk, kp), lambda n, c, g, s: (g, n, c, 0))
  part_v = pl.BlockSpec((None, None, chunk, vp), lambda n, c, g, s: (s, n, c, 0))
  state = pl.BlockSpec((None, None, vp, kp), lambda n, c, g, s: (n, c, 0, 0))
  start = pl.BlockSpec((None, None, vp, m_starts.shape[-1]),
                       lambda n, c, g, s: (n + first, c, 0, 0))
  scratch = pl.BlockSpec((None, None, None, None, chunk // sub, block_v, k_width),
                         lambda n, c, g, s: (n, c, g, s, 0, 0, 0))
  f32 = jnp.float32
  kernel = functools.partial(_backward_kernel, chunk=chunk, sub=sub, block_v=block_v,
                             k_part=k_part, k_width=k_width,
                             num_tiles=num_tiles // groups, prefetch=prefetch,
                             with_var=with_var, interpret=interpret)
  if with_var:
    dvar_spec = row_v
  else:
    dvar = jnp.zeros((1, chunk, vp), f32)  # Never read.
    dvar_spec = pl.BlockSpec((None, chunk, vp), lambda n, c, g, s: (0, 0, 0))
  outs = pl.pallas_call(
      kernel, grid=(bh, nc, groups, k_split),
      in_specs=[row_k, row_k, row_v, row_v,
                pl.BlockSpec((None, chunk), lambda n, c, g, s: (n + first, c)),
                pl.BlockSpec((None, kp), lambda n, c, g, s: (n + first, 0)),
                row_v, dvar_spec, start, start],
      out_specs=[part_k, part_k, part_v, part_v,
                 pl.BlockSpec((None, None, None, chunk), lambda n, c, g, s: (s, g, n, c)),
                 state, state, scratch, scratch],
      out_shape=[jax.ShapeDtypeStruct((groups, bh, tp, kp), f32)] * 2
      + [jax.ShapeDtypeStruct((k_split, bh, tp, vp), f32)] * 2
      + [jax.ShapeDtypeStruct((k_split, groups, bh, tp), f32)]
      + [jax.ShapeDtypeStruct((bh, nc, vp, kp), f32)] * 2
      + [jax.ShapeDtypeStruct((bh, nc, groups, k_split, chunk // sub, block_v, k_width),
                              f32)] * 2,
      compiler_params=triton_params(num_warps, interpret), interpret=interpret,
      name="palimpsa_walk_backward",
  )(q, k, v, beta, a, ip_row, do, dvar, m_starts, b_starts)
  return outs[:7]


def launch(cfg: GpuKernelConfig, q, k, v, beta, a, ip_row, do, dvar, m_starts, b_starts, *,
           bh_range: tuple[int, int] | None = None):
  """`walk_backward` with cfg's tiles (arguments as there)."""
  own = cfg.walk_bwd
  return walk_backward(q, k, v, beta, a, ip_row, do, dvar, m_starts, b_starts, heads=cfg.h,
                       chunk=cfg.chunk, block_v=own.block_v, sub=own.sub, groups=own.groups,
                       k_part=own.k_part, k_split=own.k_split, num_warps=own.num_warps,
                       interpret=cfg.interpret, prefetch=own.prefetch, bh_range=bh_range)
