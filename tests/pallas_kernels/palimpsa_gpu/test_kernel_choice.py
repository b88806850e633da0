"""Which kernel runs each stage, and with which tiles, pinned for representative calls.

`make_config` picks, per stage (boundary states, forward walk, backward walk, adjoint carries),
the Mosaic GPU or the Triton kernel from the call's sizes and dtypes and the device; these
tests fix that choice (and the tiles) for the three GPU implementations of the op, so that a
change to where the choice is made cannot change what is chosen. CPU only: the device is
stood in for (compute capability, device count).
"""

import jax
import jax.numpy as jnp
import pytest

from palimpsa_jax.ops.palimpsa.implementations import GPU_BACKENDS
from pallas_kernels.palimpsa_gpu import config as gpu_config
from pallas_kernels.palimpsa_gpu import make_config, stages

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
STAGE_NAMES = {"boundary_fwd": "boundary states", "walk_fwd": "forward walk",
               "walk_bwd": "backward walk", "carries_bwd": "adjoint carries"}
# Backward-walk calls (temp-memory pieces) per device, where not 1.
PIECES = {("d760", "interpreted"): 4, ("d760", "interpreted on 4 devices"): 8,
          ("d760", "sm_80"): 8}
# "pallas_gpu_triton" on sm_90: every tile field.
TILES = {
    "mqar": dict(block_v=32, block_v_bwd=32, block_v_boundary=32, k_part=8, k_part_boundary=16,
                 k_part_bwd=8, unroll=2, sub=4, groups_bwd=1, num_warps=1, num_warps_bwd=1,
                 num_warps_boundary=1, k_split_bwd=1, prefetch_bwd=False),
    "d170": dict(block_v=16, block_v_bwd=16, block_v_boundary=16, k_part=16, k_part_boundary=16,
                 k_part_bwd=16, unroll=2, sub=4, groups_bwd=3, num_warps=1, num_warps_bwd=1,
                 num_warps_boundary=1, k_split_bwd=3, prefetch_bwd=True),
    "d760": dict(block_v=16, block_v_bwd=16, block_v_boundary=64, k_part=32, k_part_boundary=32,
                 k_part_bwd=16, unroll=2, sub=4, groups_bwd=12, num_warps=2, num_warps_bwd=1,
                 num_warps_boundary=4, k_split_bwd=6, prefetch_bwd=True),
    "k144": dict(block_v=16, block_v_bwd=16, block_v_boundary=16, k_part=16, k_part_boundary=16,
                 k_part_bwd=16, unroll=2, sub=4, groups_bwd=1, num_warps=1, num_warps_bwd=1,
                 num_warps_boundary=1, k_split_bwd=9, prefetch_bwd=True),
    "f32_chunk128": dict(block_v=16, block_v_bwd=16, block_v_boundary=64, k_part=32,
                         k_part_boundary=32, k_part_bwd=16, unroll=2, sub=4, groups_bwd=4,
                         num_warps=2, num_warps_bwd=1, num_warps_boundary=4, k_split_bwd=2,
                         prefetch_bwd=True),
    "odd": dict(block_v=32, block_v_bwd=32, block_v_boundary=32, k_part=8, k_part_boundary=16,
                k_part_bwd=8, unroll=2, sub=4, groups_bwd=1, num_warps=1, num_warps_bwd=1,
                num_warps_boundary=1, k_split_bwd=1, prefetch_bwd=False),
    "wide_f32": dict(block_v=16, block_v_bwd=16, block_v_boundary=64, k_part=32,
                     k_part_boundary=32, k_part_bwd=16, unroll=2, sub=4, groups_bwd=16,
                     num_warps=2, num_warps_bwd=1, num_warps_boundary=4, k_split_bwd=16,
                     prefetch_bwd=True),
}
# "pallas_gpu" on sm_90 takes the same tiles, but where it runs the boundary states on Mosaic
# GPU, that kernel's K-part (and the Triton boundary kernel's warps go unused).
MOSAIC_K_PART_BOUNDARY = {"mqar": 16, "d170": 48, "d760": 96, "k144": 48, "f32_chunk128": 32,
                          "odd": 16}


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
  return "".join(getattr(cfg, stage)[0].upper() for stage in STAGE_NAMES)


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
    stage = list(STAGE_NAMES.values())[want.index("T")]
    with pytest.raises(NotImplementedError, match=f"Mosaic GPU kernel of the {stage} cannot"):
      _config(monkeypatch, call, device, "pallas_gpu_mosaic")
  assert auto.accumulate_bwd == (not DEVICES[device][0])
  assert stages.walk_pieces(auto) == PIECES.get((call, device), 1)


@pytest.mark.parametrize("call", CALLS)
def test_tiles_are_pinned(monkeypatch, call):
  tiles = lambda cfg, names: {name: getattr(cfg, name) for name in names}
  triton = _config(monkeypatch, call, "sm_90", "pallas_gpu_triton")
  assert tiles(triton, TILES[call]) == TILES[call]
  auto = _config(monkeypatch, call, "sm_90", "pallas_gpu")
  want = dict(TILES[call])
  if call in MOSAIC_K_PART_BOUNDARY:
    want["k_part_boundary"] = MOSAIC_K_PART_BOUNDARY[call]
    del want["num_warps_boundary"]
  assert tiles(auto, want) == want
