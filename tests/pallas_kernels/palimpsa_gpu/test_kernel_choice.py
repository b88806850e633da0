"""Which kernel runs each stage, and with which tiles, pinned for representative calls.

`make_config` picks, per stage (boundary states, forward walk, backward walk, adjoint carries),
the Mosaic GPU or the Triton kernel from the call's sizes and dtypes and the device; these
tests fix that choice (and the tiles) for the three GPU implementations of the op, so that a
change to where the choice is made cannot change what is chosen. CPU only: the device is
stood in for (compute capability, device count).
"""

import dataclasses
import types
from typing import ClassVar

import jax
import jax.numpy as jnp
import pytest

from palimpsa_jax.ops.palimpsa.implementations import GPU_BACKENDS
from pallas_kernels.palimpsa_gpu import (boundary_mosaic, boundary_triton, carries_mosaic,
                                         carries_triton, make_config, stages,
                                         walk_backward_mosaic, walk_backward_triton,
                                         walk_forward_mosaic, walk_forward_triton)
from pallas_kernels.palimpsa_gpu import config as gpu_config

bf16, f32 = jnp.bfloat16, jnp.float32
# name: ((B, T, H, K, V), dtype of q, k, v, beta, return_variance, chunk_size).
CALLS = {
    "mqar": ((64, 1024, 8, 16, 32), bf16, False, 64),
    "d170": ((4, 4096, 16, 48, 48), bf16, True, 64),
    "d760": ((4, 4096, 16, 96, 192), bf16, False, 64),
    "k144": ((1, 64, 1, 144, 16), f32, False, 64),  # K past the Mosaic forward walk's 128.
    "f32_chunk128": ((2, 256, 2, 32, 64), f32, False, 128),  # Past Mosaic's backward smem.
    "odd": ((2, 37, 2, 8, 20), f32, True, 16),  # T, K and V padded.
    "wide_f32": ((1, 512, 2, 256, 256), f32, True, 128),  # Past Mosaic's boundary smem.
}
# Devices: (interpret, compute capability, local device count).
DEVICES = {
    "interpreted": (True, (0, 0), 1),
    "interpreted on 4 devices": (True, (0, 0), 4),
    "sm_90": (False, (9, 0), 1),
    "sm_100": (False, (10, 0), 1),
    "sm_80": (False, (8, 0), 1),
}
# "pallas_gpu": each stage's kernel (M: Mosaic GPU, T: Triton) in the order boundary states,
# forward walk, backward walk, adjoint carries, on each device in DEVICES' order.
AUTO = {
    "mqar": ("MMMM", "TTTT", "MMMM", "TMMM", "TTTT"),
    "d170": ("MMMM", "TTTT", "MMMM", "TMMM", "TTTT"),
    "d760": ("MMMM", "TTTT", "MMMM", "TMMM", "TTTT"),
    "k144": ("MTMM", "TTTT", "MTMM", "TTMM", "TTTT"),
    "f32_chunk128": ("MMMM", "TTTT", "MMTM", "TMTM", "TTTT"),
    "odd": ("MMMM", "TTTT", "MMMM", "TMMM", "TTTT"),
    "wide_f32": ("MTMM", "TTTT", "TTTM", "TTTM", "TTTT"),
}
# Backward-walk calls (temp-memory pieces) per device, where not 1.
PIECES = {("d760", "interpreted"): 4, ("d760", "interpreted on 4 devices"): 8,
          ("d760", "sm_80"): 8}
# "pallas_gpu_triton" on sm_90: every stage's tiles.
TILES = {
    "mqar": dict(
        boundary_fwd=boundary_triton.BoundaryTritonTiles(k_part=16, block_v=32, num_warps=1),
        walk_fwd=walk_forward_triton.WalkForwardTritonTiles(k_part=8, block_v=32, num_warps=1,
                                                            unroll=2),
        walk_bwd=walk_backward_triton.WalkBackwardTritonTiles(
            k_part=8, k_split=1, block_v=32, groups=1, sub=4, num_warps=1, prefetch=False)),
    "d170": dict(
        boundary_fwd=boundary_triton.BoundaryTritonTiles(k_part=16, block_v=16, num_warps=1),
        walk_fwd=walk_forward_triton.WalkForwardTritonTiles(k_part=16, block_v=16, num_warps=1,
                                                            unroll=2),
        walk_bwd=walk_backward_triton.WalkBackwardTritonTiles(
            k_part=16, k_split=3, block_v=16, groups=3, sub=4, num_warps=1, prefetch=True)),
    "d760": dict(
        boundary_fwd=boundary_triton.BoundaryTritonTiles(k_part=32, block_v=64, num_warps=4),
        walk_fwd=walk_forward_triton.WalkForwardTritonTiles(k_part=32, block_v=16, num_warps=2,
                                                            unroll=2),
        walk_bwd=walk_backward_triton.WalkBackwardTritonTiles(
            k_part=16, k_split=6, block_v=16, groups=12, sub=4, num_warps=1, prefetch=True)),
    "k144": dict(
        boundary_fwd=boundary_triton.BoundaryTritonTiles(k_part=16, block_v=16, num_warps=1),
        walk_fwd=walk_forward_triton.WalkForwardTritonTiles(k_part=16, block_v=16, num_warps=1,
                                                            unroll=2),
        walk_bwd=walk_backward_triton.WalkBackwardTritonTiles(
            k_part=16, k_split=9, block_v=16, groups=1, sub=4, num_warps=1, prefetch=True)),
    "f32_chunk128": dict(
        boundary_fwd=boundary_triton.BoundaryTritonTiles(k_part=32, block_v=64, num_warps=4),
        walk_fwd=walk_forward_triton.WalkForwardTritonTiles(k_part=32, block_v=16, num_warps=2,
                                                            unroll=2),
        walk_bwd=walk_backward_triton.WalkBackwardTritonTiles(
            k_part=16, k_split=2, block_v=16, groups=4, sub=4, num_warps=1, prefetch=True)),
    "odd": dict(
        boundary_fwd=boundary_triton.BoundaryTritonTiles(k_part=16, block_v=32, num_warps=1),
        walk_fwd=walk_forward_triton.WalkForwardTritonTiles(k_part=8, block_v=32, num_warps=1,
                                                            unroll=2),
        walk_bwd=walk_backward_triton.WalkBackwardTritonTiles(
            k_part=8, k_split=1, block_v=32, groups=1, sub=4, num_warps=1, prefetch=False)),
    "wide_f32": dict(
        boundary_fwd=boundary_triton.BoundaryTritonTiles(k_part=32, block_v=64, num_warps=4),
        walk_fwd=walk_forward_triton.WalkForwardTritonTiles(k_part=32, block_v=16, num_warps=2,
                                                            unroll=2),
        walk_bwd=walk_backward_triton.WalkBackwardTritonTiles(
            k_part=16, k_split=16, block_v=16, groups=16, sub=4, num_warps=1, prefetch=True)),
}
# "pallas_gpu" on sm_90: the Mosaic boundary kernel's K-part where it runs the boundary states
# (every call here but wide_f32).
MOSAIC_K_PART_BOUNDARY = {"mqar": 16, "d170": 48, "d760": 96, "k144": 48, "f32_chunk128": 32,
                          "odd": 16}
# The tiles of the Mosaic kernels with no K-part (fixed tiles; the backward walk's sub-chunks).
MOSAIC_TILES = dict(walk_fwd=walk_forward_mosaic.WalkForwardMosaicTiles(),
                    walk_bwd=walk_backward_mosaic.WalkBackwardMosaicTiles(sub=4),
                    carries_bwd=carries_mosaic.CarriesMosaicTiles())


def _config(monkeypatch, call: str, device: str, implementation: str):
  (b, t, h, k, v), dtype, with_var, chunk = CALLS[call]
  interpret, capability, devices = DEVICES[device]
  monkeypatch.setattr(gpu_config, "compute_capability", lambda: capability)
  monkeypatch.setattr(jax, "local_device_count", lambda: devices)
  monkeypatch.setenv("XLA_FLAGS", "")
  sds = jax.ShapeDtypeStruct
  return make_config(sds((b, t, h, k), dtype), sds((b, t, h, v), dtype), sds((b, t, h), f32),
                     sds((h,), f32), return_variance=with_var, chunk_size=chunk,
                     interpret=interpret, k_dtype=dtype, beta_dtype=dtype,
                     backend=GPU_BACKENDS[implementation])


def _kernels(cfg) -> str:
  return "".join(backend[0].upper() for backend in cfg.backends)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("call", CALLS)
def test_each_implementation_picks_the_pinned_kernels(monkeypatch, call, device):
  want = AUTO[call][list(DEVICES).index(device)]
  auto = _config(monkeypatch, call, device, "pallas_gpu")
  assert _kernels(auto) == want
  assert _kernels(_config(monkeypatch, call, device, "pallas_gpu_triton")) == "TTTT"
  if want == "MMMM":
    assert _config(monkeypatch, call, device, "pallas_gpu_mosaic") == auto
  else:  # The first stage left to Triton is named.
    stage = list(gpu_config.STAGES.values())[want.index("T")]
    with pytest.raises(NotImplementedError, match=f"mosaic kernel of the {stage} cannot"):
      _config(monkeypatch, call, device, "pallas_gpu_mosaic")
  assert auto.accumulate_bwd == (not DEVICES[device][0])
  assert stages.walk_pieces(auto) == PIECES.get((call, device), 1)


@pytest.mark.parametrize("call", CALLS)
def test_tiles_are_pinned(monkeypatch, call):
  """Each stage's tiles on sm_90: the Triton kernels' under "pallas_gpu_triton"; under
  "pallas_gpu", each stage's chosen kernel's (Mosaic's where AUTO pins M)."""
  triton = _config(monkeypatch, call, "sm_90", "pallas_gpu_triton")
  want = {**TILES[call], "carries_bwd": carries_triton.CarriesTritonTiles()}
  assert {stage: getattr(triton, stage) for stage in gpu_config.STAGES} == want
  auto = _config(monkeypatch, call, "sm_90", "pallas_gpu")
  on_mosaic = AUTO[call][list(DEVICES).index("sm_90")]
  for stage, kernel in zip(gpu_config.STAGES, on_mosaic):
    if kernel == "T":
      assert getattr(auto, stage) == want[stage], stage
    elif stage == "boundary_fwd":
      assert auto.boundary_fwd == boundary_mosaic.BoundaryMosaicTiles(
          k_part=MOSAIC_K_PART_BOUNDARY[call])
    else:
      assert getattr(auto, stage) == MOSAIC_TILES[stage], stage


@dataclasses.dataclass(frozen=True)
class _ThirdTiles:
  backend: ClassVar[str] = "third"
  kp: int


def test_a_third_kernel_for_one_stage_is_one_entry_of_its_row(monkeypatch):
  """A new kernel for a stage is its module and one entry in the stage's row of KERNELS: "auto"
  takes it where it comes first and supports the call (else the next), stages.run launches it
  with its tiles, and the other stages and the named backends do not change."""
  launched = []
  third = types.SimpleNamespace(
      supports=lambda call: None if call.kp <= 32 else "it takes K up to 32",
      tiles=lambda call: _ThirdTiles(call.kp),
      launch=lambda cfg, *arrays: launched.append((cfg.walk_fwd, arrays)))
  monkeypatch.setitem(stages.KERNELS, "walk_fwd", {"third": third, **stages.KERNELS["walk_fwd"]})
  cfg = _config(monkeypatch, "mqar", "sm_90", "pallas_gpu")
  assert cfg.backends == ("mosaic", "third", "mosaic", "mosaic")
  assert cfg.walk_fwd == _ThirdTiles(kp=16)
  stages.run("walk_fwd", cfg, "rows")
  assert launched == [(_ThirdTiles(kp=16), ("rows",))]
  assert _config(monkeypatch, "d170", "sm_90", "pallas_gpu").backends[1] == "mosaic"  # K=48.
  assert _config(monkeypatch, "mqar", "sm_90", "pallas_gpu_triton").backends == ("triton",) * 4
  assert _config(monkeypatch, "mqar", "sm_90", "pallas_gpu_mosaic").backends == ("mosaic",) * 4
