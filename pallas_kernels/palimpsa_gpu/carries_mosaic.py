"""The backward's adjoint carries as a Pallas Mosaic GPU kernel (Hopper and newer).

Same outputs as `carries_triton.adjoint_carries`: carry_{NC-1} = end and
carry_{c-1} = local_c + gate_c * carry_c for M and Ibar, walking the chunks in reverse.
The scan is elementwise over the state and memory-bound, so:

- Each state [Vp, Kw] is read flat (S = Vp * Kw entries, contiguous per batch*head and
  chunk); a CTA (one warpgroup) walks one `tile` of S for one batch*head, so the grid is
  BH x S / tile CTAs. Every copy is one contiguous bulk TMA (no tensor map).
- Each chunk's local adjoints come by TMA into a ring of `depth` slots, issued depth - 1
  chunks ahead; the carries stay in registers (a strided layout, 16-byte vectors where
  the tile allows). A slot is also its chunk's output staging: once read, it receives the
  carry entering the chunk, which leaves by TMA, and the slot is refilled as soon as that
  copy has read it. The end state arrives in the last slot, which the first refill
  reuses; the initial-state adjoints leave through slot 0.
- The chunk gates of the batch*head sit in shared memory, one scalar load per chunk.
"""

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.palimpsa_gpu.config import GpuKernelConfig, StageCall, mosaic_refusal
from pallas_kernels.palimpsa_gpu.launch_mosaic import mosaic_kernel

f32 = jnp.float32
WARPGROUP = 128
# Largest flat tile a CTA walks (8 KiB per state and slot) and ring slots: at D760
# (BH=64, S=18432) 576 CTAs of 64 KiB of shared memory, three per SM.
MAX_TILE = 2048
DEPTH = 4
HOPPER_ONLY = False  # Hopper and newer.


def supports(call: StageCall) -> str | None:
  """None where the call's device runs it (Hopper and newer): it takes every call the op
  takes (its states' Vp * Kw is a multiple of 256); else why not."""
  return mosaic_refusal(True, call, hopper_only=HOPPER_ONLY)


@dataclasses.dataclass(frozen=True)
class CarriesMosaicTiles:
  """None to choose: the flat tile follows from the state's size at launch."""

  backend: ClassVar[str] = "mosaic"


def tiles(call: StageCall) -> CarriesMosaicTiles:
  del call
  return CarriesMosaicTiles()


def default_tile(state_size: int) -> int:
  """The largest multiple of 256 dividing state_size (itself one) up to MAX_TILE."""
  return max(t for t in range(256, MAX_TILE + 1, 256) if state_size % t == 0)


def _kernel(g_g, em_g, eb_g, am_g, ab_g, cm_g, cb_g, m0_g, b0_g, ring_m, ring_b, g_s,
            ring_bars, start_bar, *, num_chunks, tile, depth, vec_size):
  """One CTA: one flat tile of one batch*head, over all chunks in reverse.

  g_g: gates [BH, NCp]; em_g, eb_g: end states [BH, S]; am_g, ab_g: local adjoints
  [BH, NC, S]; cm_g, cb_g [BH, NC, S] and m0_g, b0_g [BH, S]: the outputs; ring_m,
  ring_b: [depth, tile] slots; g_s: [NCp] gates.
  """
  j, n = jax.lax.axis_index("t"), jax.lax.axis_index("n")
  cols = pl.ds(j * tile, tile)
  layout = plgpu.Layout.WG_STRIDED((tile,), vec_size)

  # In bounds, so each copy is one contiguous bulk copy (no tensor map, no 256 limit).
  copy_in = functools.partial(plgpu.copy_gmem_to_smem,
                              oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)

  def fetch(i):  # Step i's chunk (num_chunks - 1 - i) into slot i % depth.
    slot, c = i % depth, num_chunks - 1 - i
    copy_in(am_g.at[n, c, cols], ring_m.at[slot], ring_bars.at[slot])
    copy_in(ab_g.at[n, c, cols], ring_b.at[slot], ring_bars.at[slot])

  last = depth - 1
  copy_in(g_g.at[n], g_s, start_bar)
  copy_in(em_g.at[n, cols], ring_m.at[last], start_bar)
  copy_in(eb_g.at[n, cols], ring_b.at[last], start_bar)
  for i in range(min(last, num_chunks)):
    fetch(i)
  plgpu.barrier_wait(start_bar)
  cm = plgpu.load(ring_m.at[last], layout=layout)
  cb = plgpu.load(ring_b.at[last], layout=layout)

  def step(i, carry):
    cm, cb = carry
    slot, c = i % depth, num_chunks - 1 - i
    plgpu.barrier_wait(ring_bars.at[slot])
    am = plgpu.load(ring_m.at[slot], layout=layout)
    ab = plgpu.load(ring_b.at[slot], layout=layout)
    ring_m[slot] = cm  # The carry at the chunk's end, staged where its adjoints were.
    ring_b[slot] = cb
    g = g_s[c]
    plgpu.commit_smem()  # The staged carries, visible to the copies out.
    plgpu.copy_smem_to_gmem(ring_m.at[slot], cm_g.at[n, c, cols], commit_group=False)
    plgpu.copy_smem_to_gmem(ring_b.at[slot], cb_g.at[n, c, cols])

    @pl.when(i + last < num_chunks)
    def _():
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # The previous step's copies.
      fetch(i + last)
    return am + g * cm, ab + g * cb

  cm, cb = jax.lax.fori_loop(0, num_chunks, step, (cm, cb))
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  ring_m[0] = cm
  ring_b[0] = cb
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(ring_m.at[0], m0_g.at[n, cols], commit_group=False)
  plgpu.copy_smem_to_gmem(ring_b.at[0], b0_g.at[n, cols])
  plgpu.wait_smem_to_gmem(0)


def adjoint_carries(dm_end, db_end, chunk_gate, adj_m, adj_b, *, interpret: bool,
                    tile: int | None = None, depth: int = DEPTH):
  """Adjoint carries: the adjoint entering each chunk's last step from later steps.

  Args:
    dm_end, db_end: [BH, Vp, Kw] adjoints of the final state (Vp, Kw multiples of 16).
    chunk_gate: [BH, NC].
    adj_m, adj_b: [BH, NC, Vp, Kw]: each chunk's own adjoint of the state before it.
    tile: flat entries of the state per CTA, a multiple of 256 dividing Vp * Kw
      (default `default_tile`).
    depth: ring slots (chunks in flight: depth - 1), at least 2.

  Returns:
    As `carries_triton.adjoint_carries`: carry_m, carry_b [BH, NC, Vp, Kw]; dm0, db0
    [BH, Vp, Kw]; float32.
  """
  bh, nc, vp, kw = adj_m.shape
  size = vp * kw
  tile = tile or default_tile(size)
  if tile % 256 or size % tile or depth < 2:
    raise ValueError(f"tile={tile} must be a multiple of 256 dividing Vp*Kw={size}, and "
                     f"depth={depth} at least 2")
  ncp = -(-nc // 32) * 32  # Gate rows of whole 128-byte units (a copy's granule).
  gates = jnp.pad(chunk_gate.astype(f32), ((0, 0), (0, ncp - nc)))
  flat = lambda x: x.astype(f32).reshape(*x.shape[:-2], size)
  sds = jax.ShapeDtypeStruct
  # No automatic barriers: every thread reads back only what it wrote itself, or what a
  # TMA copy brought in after a barrier; stores leave through commit_smem.
  kernel = mosaic_kernel(
      functools.partial(_kernel, num_chunks=nc, tile=tile, depth=depth,
                        vec_size=4 if tile % (4 * WARPGROUP) == 0 else 2),
      out_type=[sds((bh, nc, size), f32)] * 2 + [sds((bh, size), f32)] * 2,
      scratch_types=[plgpu.SMEM((depth, tile), f32)] * 2 + [
          plgpu.SMEM((ncp,), f32), plgpu.Barrier(num_arrivals=2, num_barriers=depth),
          plgpu.Barrier(num_arrivals=3)],
      grid=(size // tile, bh), grid_names=("t", "n"), interpret=interpret,
      name="palimpsa_adjoint_carries_mosaic")
  carry_m, carry_b, dm0, db0 = kernel(gates, flat(dm_end), flat(db_end), flat(adj_m),
                                      flat(adj_b))
  state = lambda x: x.reshape(*x.shape[:-1], vp, kw)
  return state(carry_m), state(carry_b), state(dm0), state(db0)


def launch(cfg: GpuKernelConfig, dm_end, db_end, chunk_gate, adj_m, adj_b):
  """`adjoint_carries` with its default tile and depth (arguments as there)."""
  return adjoint_carries(dm_end, db_end, chunk_gate, adj_m, adj_b, interpret=cfg.interpret)
