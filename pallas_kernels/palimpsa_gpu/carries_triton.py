"""The backward's adjoint carries as a Pallas (Triton) kernel: the scan of
`boundary_triton` in reverse over chunks, without chunk writes."""

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import k_parts, largest_power_of_two_dividing
from pallas_kernels.palimpsa_gpu.config import GpuKernelConfig, StageCall, largest_block_v
from pallas_kernels.palimpsa_gpu.launch_triton import triton_params

# State entries per program at most: the V-tile is the largest that keeps within them.
TILE_ENTRIES = 1024


def supports(call: StageCall) -> str | None:
  """None: it runs every call the op takes (K, V <= 256, any dtypes, any device)."""
  del call


@dataclasses.dataclass(frozen=True)
class CarriesTritonTiles:
  """None to choose: the V-tile follows from the state's width at launch."""

  backend: ClassVar[str] = "triton"


def tiles(call: StageCall) -> CarriesTritonTiles:
  del call
  return CarriesTritonTiles()


def _carries_kernel(g_ref, am_ref, ab_ref, em_ref, eb_ref, cm_ref, cb_ref, m0_ref,
                    b0_ref, *, num_chunks, unroll):
  """Reverse over chunks for one (batch*head, V-tile): carry_{c-1} = local_c + g_c carry_c."""
  kw = em_ref.shape[-1]
  parts = k_parts(kw, largest_power_of_two_dividing(kw))

  def steps(i, carry):
    cms, cbs = carry
    last = num_chunks - 1 - i * unroll
    # Loads first: they do not depend on the carry, so their latency overlaps.
    rows = [(g_ref[last - u], [am_ref[last - u, :, p] for p in parts],
             [ab_ref[last - u, :, p] for p in parts]) for u in range(unroll)]
    for u, (g, ams, abs_) in enumerate(rows):
      for p, cm, cb in zip(parts, cms, cbs):
        cm_ref[last - u, :, p] = cm
        cb_ref[last - u, :, p] = cb
      cms = [a + g * cm for a, cm in zip(ams, cms)]
      cbs = [a + g * cb for a, cb in zip(abs_, cbs)]
    return cms, cbs

  initial = ([em_ref[:, p] for p in parts], [eb_ref[:, p] for p in parts])
  cms, cbs = jax.lax.fori_loop(0, num_chunks // unroll, steps, initial)
  for p, cm, cb in zip(parts, cms, cbs):
    m0_ref[:, p] = cm
    b0_ref[:, p] = cb


def adjoint_carries(dm_end, db_end, chunk_gate, adj_m, adj_b, *, block_v: int,
                    interpret: bool):
  """Adjoint carries: the adjoint entering each chunk's last step from later steps.

  carry_{NC-1} = end; carry_{c-1} = local_c + chunk_gate_c * carry_c, for M and Ibar,
  as one Pallas kernel per (batch*head, V-tile) walking the chunks in reverse.

  Args:
    dm_end, db_end: [BH, Vp, Kw] adjoints of the final state (Kw a multiple of 16).
    chunk_gate: [BH, NC].
    adj_m, adj_b: [BH, NC, Vp, Kw]: each chunk's own adjoint of the state before it.
    block_v: V-tile (a power of two dividing Vp).

  Returns:
    carry_m, carry_b [BH, NC, Vp, Kw] (carries at chunk ends); dm0, db0 [BH, Vp, Kw]
    (adjoints of the initial state); float32.
  """
  bh, nc, vp, kw = adj_m.shape
  unroll = next(u for u in (4, 2, 1) if nc % u == 0)
  chunks = pl.BlockSpec((None, nc, block_v, kw), lambda n, j: (n, 0, j, 0))
  state = pl.BlockSpec((None, block_v, kw), lambda n, j: (n, j, 0))
  f32 = jnp.float32
  kernel = functools.partial(_carries_kernel, num_chunks=nc, unroll=unroll)
  return pl.pallas_call(
      kernel, grid=(bh, vp // block_v),
      in_specs=[pl.BlockSpec((None, nc), lambda n, j: (n, 0)), chunks, chunks, state,
                state],
      out_specs=[chunks, chunks, state, state],
      out_shape=[jax.ShapeDtypeStruct((bh, nc, vp, kw), f32)] * 2
      + [jax.ShapeDtypeStruct((bh, vp, kw), f32)] * 2,
      compiler_params=triton_params(4, interpret), interpret=interpret,
      name="palimpsa_adjoint_carries",
  )(chunk_gate, adj_m, adj_b, dm_end, db_end)


def launch(cfg: GpuKernelConfig, dm_end, db_end, chunk_gate, adj_m, adj_b):
  """`adjoint_carries` over V-tiles of at most TILE_ENTRIES state entries (arguments as
  there)."""
  _, _, vp, kw = adj_m.shape
  return adjoint_carries(dm_end, db_end, chunk_gate, adj_m, adj_b,
                         block_v=largest_block_v(vp, kw, TILE_ENTRIES), interpret=cfg.interpret)
