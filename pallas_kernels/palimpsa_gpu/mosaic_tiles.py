"""Register-level operations on the Mosaic walk's [4, 16, 16] state tiles (one [16, 16]
tile per warp): the tile layout, FMA and reciprocal as single PTX instructions, and the
per-step sums as warp-shuffle reduce-scatters. Interpreted, plain jnp stands in for each.
"""

import jax.numpy as jnp
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref, vector

from pallas_kernels.palimpsa_gpu.mosaic_internals import fast_instr, pointwise

f32 = jnp.float32

TILE = 16  # V-rows and K-columns of one walk's state tile.
WALKS = 4  # Walks per warpgroup: one per warp.
# [4, 16, 16] arrays, warp w holding [w]: each lane 8 entries (2 V-rows x 4 K-columns).
TILE_PER_WARP = plgpu.Layout.TILED(
    plgpu.Tiling(((WALKS, TILE, 8), (8, 8), (2,))), warp_dims=(-6,), lane_dims=(-3, -2),
    vector_dim=-1)
K_ROWS = TILE_PER_WARP.reduce(1)  # [4, 16] (walk, k): a k-indexed row per warp.
V_ROWS = TILE_PER_WARP.reduce(2)  # [4, 16] (walk, v): a v-indexed row per warp.


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
  (run 21: 20 fewer SASS instructions per step than multiplying the tiles first, of
  about 370; fwd+bwd 1.02-1.03x), and the sums across
  lanes are reduce-scatters: each butterfly round sends half of a lane's values to its
  partner and keeps the other half, so the lanes end with different sums and each stores
  its own (sum over V: 4 shuffles instead of 12; over K: 2 instead of 4; both: 5 instead
  of 7). Lane = 4 v_lo + k_pair holds v in {v_lo, v_lo + 8} and k in
  {8 k_hi + 2 k_pair + e}; registers [k_hi, v_half] of vector<2> (e).
  """
  if interpret:
    def sum_v(x, ref):
      ref[...] = jnp.sum(x, axis=1)

    def sum_k(x, ref):
      ref[...] = jnp.sum(x, axis=2)

    def sum_all(x, ref):
      ref[...] = jnp.sum(jnp.sum(x, axis=2), axis=1)

    def sum_v_dk(gm, v, gb, beta, k, ref):
      sum_v(gm * v + (gb * (2.0 * beta)) * k, ref)
    return (sum_v, lambda x, y, ref: sum_v(x * y, ref), sum_v_dk,
            lambda x, y, ref: sum_k(x * y, ref), sum_all)

  utils = mgpu.utils
  i32 = lambda: ir.IntegerType.get_signless(32)  # MLIR types exist inside the kernel only.
  fma = fast_instr("fma.rn.f32")  # Scalars or vectors.
  tile = TILE_PER_WARP

  def regs(x):
    """x's registers [k_hi][v_half] (vector<2> over e)."""
    return x.registers.reshape(2, 2)

  def place(x):
    """The index of x's first entry held by this lane, and the lane."""
    first = next(iter(x.layout.thread_idxs(x.shape)))
    return first, arith.remui(utils.thread_idx(), utils.c(32, i32()))

  def bit(lane, b):
    return arith.cmpi(arith.CmpIPredicate.ne,
                      arith.andi(lane, utils.c(1 << b, i32())), utils.c(0, i32()))

  def exchange(keep_second, a, b, distance):
    """keep_second ? b : a, plus the partner's other one (lanes `distance` apart)."""
    keep = arith.select(keep_second, b, a)
    send = arith.select(keep_second, a, b)
    return arith.addf(keep, utils.shfl_bfly(send, distance))

  def element(v, i):
    return vector.extract(v, dynamic_position=[],
                          static_position=ir.DenseI64ArrayAttr.get([i]))

  def offset(base, flag, amount):
    return arith.addi(base, arith.index_cast(
        ir.IndexType.get(), arith.select(flag, utils.c(amount, i32()), utils.c(0, i32()))))

  def store_over_v(rows, x, ref):
    """rows: the lane's sums over its two V-rows, a vector<2> (e) per k_hi."""
    (walk, _, k0), lane = place(x)
    high, odd = bit(lane, 4), bit(lane, 3)
    pair = exchange(high, rows[0], rows[1], 16)  # k_hi = lane bit 4
    one = exchange(odd, element(pair, 0), element(pair, 1), 8)  # e = lane bit 3
    total = arith.addf(one, utils.shfl_bfly(one, 4))
    memref.store(total, ref, [walk, offset(offset(k0, high, 8), odd, 1)])

  def store_over_k(halves, x, ref):
    """halves: the lane's sums over its four K-columns, a scalar per v_half."""
    (walk, v0, _), lane = place(x)
    second = bit(lane, 1)
    one = exchange(second, halves[0], halves[1], 2)  # v_half = lane bit 1
    total = arith.addf(one, utils.shfl_bfly(one, 1))
    memref.store(total, ref, [walk, offset(v0, second, 8)])

  @plgpu.inline_mgpu(arg_types=(tile, plgpu.RefType()))
  def sum_v(_, x, ref):
    r = regs(x)
    store_over_v([arith.addf(r[h, 0], r[h, 1]) for h in range(2)], x, ref)

  @plgpu.inline_mgpu(arg_types=(tile, tile, plgpu.RefType()))
  def sum_v_of_products(_, x, y, ref):
    rx, ry = regs(x), regs(y)
    store_over_v([fma(rx[h, 1], ry[h, 1], arith.mulf(rx[h, 0], ry[h, 0]))
                  for h in range(2)], x, ref)

  @plgpu.inline_mgpu(arg_types=(tile,) * 5 + (plgpu.RefType(),))
  def sum_v_dk(_, gm, v, gb, beta, k, ref):
    rgm, rv, rgb, rbeta, rk = (regs(x) for x in (gm, v, gb, beta, k))
    rows = []
    for h in range(2):
      gb_beta = fma(rgb[h, 1], rbeta[h, 1], arith.mulf(rgb[h, 0], rbeta[h, 0]))
      gm_v = fma(rgm[h, 1], rv[h, 1], arith.mulf(rgm[h, 0], rv[h, 0]))
      rows.append(fma(gb_beta, arith.addf(rk[h, 0], rk[h, 0]), gm_v))
    store_over_v(rows, gm, ref)

  @plgpu.inline_mgpu(arg_types=(tile, tile, plgpu.RefType()))
  def sum_k_of_products(_, x, y, ref):
    rx, ry = regs(x), regs(y)
    halves = []
    for vh in range(2):
      pairs = [(element(rx[h, vh], e), element(ry[h, vh], e)) for h in range(2)
               for e in range(2)]
      total = arith.mulf(*pairs[0])
      for a, b in pairs[1:]:
        total = fma(a, b, total)
      halves.append(total)
    store_over_k(halves, x, ref)

  @plgpu.inline_mgpu(arg_types=(tile, plgpu.RefType()))
  def sum_all(_, x, ref):
    r = regs(x)
    (walk, _, _), _ = place(x)
    rows = [arith.addf(r[h, 0], r[h, 1]) for h in range(2)]
    both = arith.addf(rows[0], rows[1])
    total = arith.addf(element(both, 0), element(both, 1))
    for distance in (1, 2, 4, 8, 16):
      total = arith.addf(total, utils.shfl_bfly(total, distance))
    memref.store(total, ref, [walk])

  return sum_v, sum_v_of_products, sum_v_dk, sum_k_of_products, sum_all
