"""The tiles of Fast Palimpsa's fused chunk-read kernels, and the per-step rows they read."""

import dataclasses

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

# The per-step rows [BH, Tp / R, NUM_ROWS, R] float32 the kernels read (`reads.step_rows`):
ROW_G = 0  # g_t: the cumulative log-decay from the chunk's start up to step t.
ROW_ID = 1  # a segment id, unique per (chunk, segment): D[t, s] needs id_t == id_s.
ROW_F = 2  # f_t: the decay from the chunk's start to t (0 after a restart in the chunk).
ROW_CS = 3  # f_t / mean(Ibar_c + Ip): the carried read's per-step factor.
ROW_IP = 4  # Ip (the head's prior precision), per step.
ROW_MB = 5  # mean_v beta_t.
NUM_ROWS = 6

MIN_ROWS = 64  # A wgmma's M: a CTA reads whole chunks, at least 64 rows.


@dataclasses.dataclass(frozen=True)
class ForwardTiles:
  """How the forward kernel cuts one batch*head's reads.

  chunk: steps per chunk (C). A CTA takes `rows` = max(C, 64) steps: 64 // C chunks when
    C < 64 (`groups`): a wgmma's M is 64.
  sub: V columns per tensor-core product (the N of the V-indexed wgmmas, a multiple of 16);
    the V-indexed accumulators hold [rows, sub] float32 each.
  num_sub: sub-tiles per CTA: a CTA reads a V-block of sub * num_sub columns.
  """

  chunk: int
  sub: int
  num_sub: int = 1

  @property
  def rows(self) -> int:
    return max(self.chunk, MIN_ROWS)

  @property
  def groups(self) -> int:
    return self.rows // self.chunk

  def v_blocks(self, vp: int) -> int:
    """CTAs along V."""
    return -(-vp // (self.sub * self.num_sub))

  def v_span(self, vp: int) -> int:
    """Columns of bv the kernel reads: Vp rounded up to whole V-blocks (and 128 bytes)."""
    return padded_width(self.v_blocks(vp) * self.sub * self.num_sub)


@dataclasses.dataclass(frozen=True)
class BackwardTiles:
  """How the backward's two kernels cut one batch*head's reads (reads_backward.py). Both
  take `rows` steps a CTA (as ForwardTiles).

  sub: V columns per sub-tile of the V-side kernel (a multiple of 16 that divides Vp, or
    at least Vp), which takes all of V, its sub-tiles passing through a ring of `slots`
    slots.
  k_sub: K columns per CTA of the K-side kernel (a multiple of 16); its products over V
    (dN) take V in pieces of 64 rows (a wgmma's M).
  """

  chunk: int
  sub: int = 64
  slots: int = 2
  k_sub: int = 32

  rows = ForwardTiles.rows
  groups = ForwardTiles.groups

  def num_sub(self, vp: int) -> int:
    return -(-vp // self.sub)

  def v_span(self, vp: int) -> int:
    """Columns of bv (and dbv) the V-side kernel reads: Vp rounded up to whole sub-tiles."""
    return padded_width(self.num_sub(vp) * self.sub)

  def k_blocks(self, kp: int) -> int:
    """CTAs along K of the K-side kernel."""
    return -(-kp // self.k_sub)

  def k_span(self, kp: int) -> int:
    """Columns of bk (and dbk) both kernels read: Kp rounded up to whole K-blocks (and 128
    bytes). Each CTA copies all of them: a TMA copy into shared memory moves a multiple of
    128 bytes, which a K-block of 16 or 48 columns is not."""
    return padded_width(self.k_blocks(kp) * self.k_sub)


V_PIECE = 64  # V rows of one dN product (a wgmma's M) in the K-side kernel.


def v_pieces(vp: int) -> list[tuple[int, int]]:
  """(start, overlap) of the K-side kernel's V pieces of 64 rows: whole pieces, the last one
  ending at Vp (overlapping its predecessor by `overlap` rows, which it leaves to it); a V
  under 64 is one piece whose rows past Vp read zeros."""
  if vp <= V_PIECE:
    return [(0, 0)]
  starts = [min(p * V_PIECE, vp - V_PIECE) for p in range(-(-vp // V_PIECE))]
  return [(start, p * V_PIECE - start) for p, start in enumerate(starts)]


def padded_width(width: int) -> int:
  """float32 entries per chunk of a marginal (bk, bv) as the kernels read it: whole
  128-byte units (a TMA copy moves a multiple of 128 bytes)."""
  return -(-width // 32) * 32


def tiled(dtype, *widths: int):
  """Transforms of a [rows, width] tile in shared memory: the largest swizzle whose tile
  (8, S) divides every width (a wgmma's contraction and a TMA copy's minor dimension)."""
  size = jnp.dtype(dtype).itemsize
  swizzle = min(plgpu.find_swizzle(w * size * 8) for w in widths)
  return (plgpu.TilingTransform((8, swizzle // size)), plgpu.SwizzleTransform(swizzle))
