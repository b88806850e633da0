"""Register-level operations on the Mosaic walks' [4, 16, 16] state tiles (one [16, 16]
tile per warp): the tile layout, FMA and reciprocal as single PTX instructions, and the
per-step sums as warp-shuffle reduce-scatters. Interpreted, plain jnp stands in for each.
Also the shared-memory budget every Mosaic kernel of the op checks its scratch against.
"""

import math

import jax
import jax.numpy as jnp
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref, vector

from pallas_kernels.palimpsa_gpu.mosaic_internals import fast_instr, pointwise

f32 = jnp.float32

# Dynamic shared memory per CTA on sm_90. Pallas (jax 0.11.2) places each scratch ref at a
# multiple of 1024 bytes and adds a reduction scratch of 2048 bytes (CompilerParams'
# reduction_scratch_bytes) and 8 bytes per barrier; 64 bytes cover the barriers.
SMEM_LIMIT = 227 * 1024
_SMEM_ALIGNMENT = 1024
_SMEM_RESERVED = 2048 + 64


def smem_bytes_of(scratch) -> int:
  """Shared memory of a CTA with these scratch refs (plgpu.SMEM), Pallas' share included."""
  return sum(-(-math.prod(ref.shape) * jnp.dtype(ref.dtype).itemsize // _SMEM_ALIGNMENT)
             * _SMEM_ALIGNMENT for ref in scratch) + _SMEM_RESERVED


TILE = 16  # V-rows and K-columns of one walk's state tile.
WALKS = 4  # Walks per warpgroup: one per warp.
# [4, 16, 16] arrays, warp w holding [w]: each lane 8 entries (2 V-rows x 4 K-columns).
TILE_PER_WARP = plgpu.Layout.TILED(
    plgpu.Tiling(((WALKS, TILE, 8), (8, 8), (2,))), warp_dims=(-6,), lane_dims=(-3, -2),
    vector_dim=-1)
K_ROWS = TILE_PER_WARP.reduce(1)  # [4, 16] (walk, k): a k-indexed row per warp.
V_ROWS = TILE_PER_WARP.reduce(2)  # [4, 16] (walk, v): a v-indexed row per warp.


def over_k(x):
  """A [4, 16] k-row per walk, broadcast over the tile's V-rows."""
  return plgpu.layout_cast(
      jax.lax.broadcast_in_dim(x, (WALKS, TILE, TILE), (0, 2)), TILE_PER_WARP)


def over_v(x):
  """A [4, 16] v-row per walk, broadcast over the tile's K-columns."""
  return plgpu.layout_cast(
      jax.lax.broadcast_in_dim(x, (WALKS, TILE, TILE), (0, 1)), TILE_PER_WARP)


# Lane-level helpers of the inline_mgpu bodies below (they build MLIR, so they run only
# while a kernel is lowered). A [4, 16, 16] TILE_PER_WARP tile gives lane = 4 v_lo + k_pair
# the entries v in {v_lo, v_lo + 8}, k in {8 k_hi + 2 k_pair + e}: registers [k_hi, v_half]
# of vector<2> (e).


def _i32():
  return ir.IntegerType.get_signless(32)


def _regs(x):
  """x's registers [k_hi][v_half] (vector<2> over e)."""
  return x.registers.reshape(2, 2)


def _place(x):
  """The index of x's first entry held by this lane, and the lane."""
  first = next(iter(x.layout.thread_idxs(x.shape)))
  return first, arith.remui(mgpu.utils.thread_idx(), mgpu.utils.c(32, _i32()))


def _bit(lane, b):
  c = mgpu.utils.c
  return arith.cmpi(arith.CmpIPredicate.ne, arith.andi(lane, c(1 << b, _i32())),
                    c(0, _i32()))


def _exchange(keep_second, a, b, distance):
  """keep_second ? b : a, plus the partner's other one (lanes `distance` apart)."""
  keep = arith.select(keep_second, b, a)
  send = arith.select(keep_second, a, b)
  return arith.addf(keep, mgpu.utils.shfl_bfly(send, distance))


def _element(v, i):
  return vector.extract(v, dynamic_position=[],
                        static_position=ir.DenseI64ArrayAttr.get([i]))


def _offset(base, flag, amount):
  c = mgpu.utils.c
  return arith.addi(base, arith.index_cast(
      ir.IndexType.get(), arith.select(flag, c(amount, _i32()), c(0, _i32()))))


def _store_over_v(rows, x, ref):
  """rows: the lane's sums over its two V-rows, a vector<2> (e) per k_hi."""
  (walk, _, k0), lane = _place(x)
  high, odd = _bit(lane, 4), _bit(lane, 3)
  pair = _exchange(high, rows[0], rows[1], 16)  # k_hi = lane bit 4
  one = _exchange(odd, _element(pair, 0), _element(pair, 1), 8)  # e = lane bit 3
  total = arith.addf(one, mgpu.utils.shfl_bfly(one, 4))
  memref.store(total, ref, [walk, _offset(_offset(k0, high, 8), odd, 1)])


def _store_over_k(halves, x, ref):
  """halves: the lane's sums over its four K-columns, a scalar per v_half; stored in
  ref's element type (rounded to nearest where that is narrower than float32)."""
  (walk, v0, _), lane = _place(x)
  second = _bit(lane, 1)
  one = _exchange(second, halves[0], halves[1], 2)  # v_half = lane bit 1
  total = arith.addf(one, mgpu.utils.shfl_bfly(one, 1))
  dtype = ir.MemRefType(ref.type).element_type
  if dtype != total.type:
    total = arith.truncf(dtype, total)
  memref.store(total, ref, [walk, _offset(v0, second, 8)])


def pointwise_ops(interpret: bool):
  """fma(x, y, z) and reciprocal(x) on [4, 16, 16] tiles: PTX fma.rn.f32 and
  rcp.approx.ftz.f32 (<= 1 ulp), as in the Triton kernels; plain jnp in interpret mode."""
  if interpret:
    return (lambda x, y, z: x * y + z), (lambda x: 1.0 / x)
  tile = plgpu.ShapeDtypeStruct((WALKS, TILE, TILE), f32, layout=TILE_PER_WARP)

  @plgpu.inline_mgpu(arg_types=(TILE_PER_WARP,) * 3, return_type=tile)
  def fma(_, x, y, z):
    return pointwise(x, fast_instr("fma.rn.f32"), y, z)

  @plgpu.inline_mgpu(arg_types=(TILE_PER_WARP,), return_type=tile)
  def reciprocal(_, x):
    return pointwise(x, fast_instr("rcp.approx.ftz.f32"))

  return fma, reciprocal


def sum_stores(interpret: bool):
  """The walk's per-step sums of [4, 16, 16] tiles, each lane storing its own into a ref:

  - sum_v(x, ref): sum over V of x (ref [4, 16], walk by k);
  - sum_v_of_products(x, y, ref): sum over V of x * y;
  - sum_v_dk(gm, v, gb, beta, k, ref): sum over V of gm v + 2 gb beta k (dL/dk), as
    k * 2 sum_v(gb beta) + sum_v(gm v) (k is constant along V);
  - sum_k_of_products(x, y, ref): sum over K of x * y (ref [4, 16], walk by v);
  - sum_all(x, ref): sum over V and K (ref [4]).

  Compiled, the products are folded into the lane's own partial sums as fma.rn chains
  (fewer instructions per step than multiplying the tiles first), and the sums across
  lanes are reduce-scatters: each butterfly round sends half of a lane's values to its
  partner and keeps the other half, so the lanes end with different sums and each stores
  its own (sum over V: 4 shuffles instead of 12; over K: 2 instead of 4; both: 5 instead
  of 7). Lane = 4 v_lo + k_pair holds v in {v_lo, v_lo + 8} and k in
  {8 k_hi + 2 k_pair + e}; registers [k_hi, v_half] of vector<2> (e).
  """
  readout = readout_stores(interpret)

  def sum_k_of_products(x, y, ref):
    readout([x], [y], ref)

  if interpret:
    def sum_v(x, ref):
      ref[...] = jnp.sum(x, axis=1)

    def sum_all(x, ref):
      ref[...] = jnp.sum(jnp.sum(x, axis=2), axis=1)

    def sum_v_dk(gm, v, gb, beta, k, ref):
      sum_v(gm * v + (gb * (2.0 * beta)) * k, ref)
    return (sum_v, lambda x, y, ref: sum_v(x * y, ref), sum_v_dk,
            sum_k_of_products, sum_all)

  fma = fast_instr("fma.rn.f32")  # Scalars or vectors.
  tile = TILE_PER_WARP

  @plgpu.inline_mgpu(arg_types=(tile, plgpu.RefType()))
  def sum_v(_, x, ref):
    r = _regs(x)
    _store_over_v([arith.addf(r[h, 0], r[h, 1]) for h in range(2)], x, ref)

  @plgpu.inline_mgpu(arg_types=(tile, tile, plgpu.RefType()))
  def sum_v_of_products(_, x, y, ref):
    rx, ry = _regs(x), _regs(y)
    _store_over_v([fma(rx[h, 1], ry[h, 1], arith.mulf(rx[h, 0], ry[h, 0]))
                   for h in range(2)], x, ref)

  @plgpu.inline_mgpu(arg_types=(tile,) * 5 + (plgpu.RefType(),))
  def sum_v_dk(_, gm, v, gb, beta, k, ref):
    rgm, rv, rgb, rbeta, rk = (_regs(x) for x in (gm, v, gb, beta, k))
    rows = []
    for h in range(2):
      gb_beta = fma(rgb[h, 1], rbeta[h, 1], arith.mulf(rgb[h, 0], rbeta[h, 0]))
      gm_v = fma(rgm[h, 1], rv[h, 1], arith.mulf(rgm[h, 0], rv[h, 0]))
      rows.append(fma(gb_beta, arith.addf(rk[h, 0], rk[h, 0]), gm_v))
    _store_over_v(rows, gm, ref)

  @plgpu.inline_mgpu(arg_types=(tile, plgpu.RefType()))
  def sum_all(_, x, ref):
    r = _regs(x)
    (walk, _, _), _ = _place(x)
    rows = [arith.addf(r[h, 0], r[h, 1]) for h in range(2)]
    both = arith.addf(rows[0], rows[1])
    total = arith.addf(_element(both, 0), _element(both, 1))
    for distance in (1, 2, 4, 8, 16):
      total = arith.addf(total, mgpu.utils.shfl_bfly(total, distance))
    memref.store(total, ref, [walk])

  return sum_v, sum_v_of_products, sum_v_dk, sum_k_of_products, sum_all


def readout_stores(interpret: bool):
  """readout(xs, ys, ref): sum over K of sum_j xs[j] * ys[j] for lists of [4, 16, 16]
  tiles (the K-tiles of one state), stored in ref's dtype (ref [4, 16], walk by v).

  Compiled, each lane folds all its products into one fma.rn chain per V-row (the
  K-tiles' products are never added as tiles), then the lanes' sums are reduced as in
  `sum_stores`' sums over K; the store rounds to ref's dtype.
  """
  if interpret:
    def readout(xs, ys, ref):
      total = sum(jnp.sum(x * y, axis=2) for x, y in zip(xs, ys))
      ref[...] = total.astype(ref.dtype)
    return readout
  fma = fast_instr("fma.rn.f32")

  def readout(xs, ys, ref):
    n = len(xs)

    @plgpu.inline_mgpu(arg_types=(TILE_PER_WARP,) * (2 * n) + (plgpu.RefType(),))
    def body(_, *args):
      xs, ys, out = args[:n], args[n:2 * n], args[-1]
      halves = []
      for vh in range(2):
        pairs = [(_element(rx[h, vh], e), _element(ry[h, vh], e))
                 for rx, ry in ((_regs(x), _regs(y)) for x, y in zip(xs, ys))
                 for h in range(2) for e in range(2)]
        total = arith.mulf(*pairs[0])
        for a, b in pairs[1:]:
          total = fma(a, b, total)
        halves.append(total)
      _store_over_k(halves, xs[0], out)

    body(*xs, *ys, ref)

  return readout
