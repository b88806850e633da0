"""`GpuKernelConfig`: the static configuration of one palimpsa_gpu call, and `make_config`.

The first fields describe the call (sizes, dtypes, mode) and follow from its arguments;
the rest are the kernels' tiles and choices, which `make_config` picks from the sizes.
A caller may pass a config of its own (e.g. `dataclasses.replace(make_config(...), ...)`
with other tiles) to `palimpsa_gpu`, which checks that its call fields match the call.

Each of the four stages (boundary states, forward walk, backward walk, adjoint carries)
has a Triton kernel and a Mosaic GPU kernel. `backend` chooses between them: "auto" takes
Mosaic per stage where it runs the call, "triton" and "mosaic" one backend for every stage.
"""

import dataclasses
import os
import re

import jax
import jax.numpy as jnp

from pallas_kernels.common import (largest_power_of_two_dividing, next_power_of_two,
                                   round_up)
from pallas_kernels.palimpsa_gpu import boundary_mosaic, walk_backward_mosaic, walk_forward_mosaic

MAX_DIM = 256
BACKENDS = ("auto", "triton", "mosaic")
DIM_MULTIPLE = 16  # K and V are padded to multiples of 16 (tensor-core tiles).
# The fields of GpuKernelConfig that describe the call rather than tune the kernels.
CALL_FIELDS = ("b", "t", "h", "k", "v", "chunk", "return_variance", "log_alpha_dtype",
               "prior_dtype", "interpret")


@dataclasses.dataclass(frozen=True)
class GpuKernelConfig:
  """Static configuration of one call.

  K is stored padded to Kp, a multiple of 16. Each stage walks K in equal power-of-two
  parts (Triton tensors have power-of-two shapes): the forward walk in parts of k_part
  columns over Kp; the boundary kernel pads K further, to a multiple of k_part_boundary,
  and the backward walk to a multiple of k_part_bwd * k_split_bwd (k_split_bwd programs
  over slices of parts; one part over all of K when k_part_bwd is a power of two >= Kp).

  Call fields (from the arguments):
    b, t, h, k, v: batch, time steps, heads, key and value widths.
    chunk: steps per chunk, a power of two in [16, 128].
    return_variance: whether the variance is returned.
    log_alpha_dtype, prior_dtype: dtype names of log_alpha and prior_precision (their
      gradients').
    interpret: whether the kernels run in Pallas interpret mode.

  Tuning fields:
    block_v: V-rows per forward-walk program.
    block_v_bwd: V-rows per Triton backward-walk tile.
    block_v_boundary: V-rows per boundary-kernel program.
    k_part, k_part_boundary, k_part_bwd: K-part widths of the three stages.
    unroll: forward-walk steps per loop body.
    sub: backward sub-chunk length (steps whose states are recomputed together).
    groups_bwd: groups of V-tiles of the Triton backward walk (one program each).
    num_warps, num_warps_bwd, num_warps_boundary: warps per program of each stage.
    k_split_bwd: K-slices of the Triton backward walk in separate programs (their dv,
      dbeta and dL/dI sums are partial, summed by XLA).
    prefetch_bwd: each Triton reverse body loads the next sub-chunk's rows first.
    max_walk_temp_bytes: the backward walk is called on slices of batch*head so that
      each call's scratch and partial sums take at most this many bytes.
    boundary_fwd: "mosaic" (boundary_mosaic: tensor cores through wgmma, Hopper sm_90
      only) or "triton" (boundary_triton.boundary_states, with the tiles above).
    walk_fwd: "mosaic" (walk_forward_mosaic: Hopper and newer, K <= 128) or "triton"
      (walk_triton.walk_forward, with the tiles above).
    walk_bwd: "mosaic" (walk_backward_mosaic: Hopper and newer, rows that fit shared memory) or
      "triton" (walk_triton.walk_backward, with the tiles above).
    carries_bwd: "mosaic" (carries_mosaic: Hopper and newer) or "triton"
      (carries_triton.adjoint_carries).
    accumulate_bwd: the Mosaic walk adds its tiles' sums by TMA reduce-add into one array
      each instead of partial sums that XLA adds (compiled only; the order of the
      additions, so the float32 rounding, varies run to run).
  """

  b: int
  t: int
  h: int
  k: int
  v: int
  chunk: int
  block_v: int
  block_v_bwd: int
  block_v_boundary: int
  k_part: int
  k_part_boundary: int
  k_part_bwd: int
  unroll: int
  sub: int
  groups_bwd: int
  return_variance: bool
  log_alpha_dtype: str
  prior_dtype: str
  interpret: bool
  num_warps: int = 4
  num_warps_bwd: int = 1
  num_warps_boundary: int = 4
  k_split_bwd: int = 1
  prefetch_bwd: bool = False
  max_walk_temp_bytes: int = 2 << 30
  boundary_fwd: str = "triton"
  walk_fwd: str = "triton"
  walk_bwd: str = "triton"
  carries_bwd: str = "triton"
  accumulate_bwd: bool = False

  @property
  def t_pad(self) -> int:
    return round_up(self.t, self.chunk) - self.t

  @property
  def walk_pieces(self) -> int:
    """Backward walk calls: the fewest dividing B*H within max_walk_temp_bytes."""
    bh, tp, vp, kp = self.b * self.h, self.t + self.t_pad, self.v + self.v_pad, self.k_bwd
    if self.walk_bwd == "mosaic":  # No scratch; the sums and the broadcast gates.
      nv, nk = vp // walk_backward_mosaic.TILE, kp // walk_backward_mosaic.TILE
      pv, pk = (1, 1) if self.accumulate_bwd else (nv, nk)
      per_head = 4 * tp * (pv * kp * 2 + pk * vp * 2 + pk * pv + walk_backward_mosaic.TILE)
    else:
      scratch = tp // self.sub * self.groups_bwd * self.block_v_bwd * kp * 2
      partials = (self.groups_bwd * kp * 2 + self.k_split_bwd * vp * 2 + 1) * tp
      per_head = 4 * (scratch + partials)
    pieces = 1
    while pieces < bh and (bh % pieces or per_head * bh // pieces > self.max_walk_temp_bytes):
      pieces += 1
    return pieces

  @property
  def k_pad(self) -> int:
    return round_up(self.k, DIM_MULTIPLE) - self.k

  @property
  def v_pad(self) -> int:
    return round_up(self.v, DIM_MULTIPLE) - self.v

  @property
  def k_boundary(self) -> int:
    """K width of the boundary kernel and of the saved-state layout it writes."""
    return round_up(self.k + self.k_pad, self.k_part_boundary)

  @property
  def k_bwd(self) -> int:
    """K width of the backward walk."""
    return round_up(self.k + self.k_pad, self.k_part_bwd * self.k_split_bwd)


def largest_block_v(v_padded: int, k_padded: int, elements: int, minimum: int = 1) -> int:
  """V-tile: the largest power of two dividing v_padded with <= `elements` per tile."""
  bv = next_power_of_two(v_padded)
  while bv > minimum and (v_padded % bv or bv * k_padded > elements):
    bv //= 2
  return bv


def forward_block_v(v_padded: int, k_part: int, num_warps: int) -> int:
  """Forward-walk V-tile: about 256 state entries per K-part and warp."""
  return min(largest_power_of_two_dividing(v_padded), 256 * num_warps // k_part)


def compute_capability() -> tuple[int, int]:
  """(major, minor) of the default device; (0, 0) where it is not a CUDA GPU."""
  version = getattr(jax.devices()[0], "compute_capability", "0.0")
  major, minor = str(version).split(".")[:2]
  return int(major), int(minor)


def deterministic_ops_requested() -> bool:
  """Whether XLA_FLAGS asks XLA for run-to-run deterministic GPU ops
  (--xla_gpu_deterministic_ops or =true); the kernel then avoids reduce-add."""
  flags = os.environ.get("XLA_FLAGS", "")
  return re.search(r"--xla_gpu_deterministic_ops(=(true|1))?(\s|$)", flags) is not None


def mosaic_refusal(mosaic_supported: bool, interpret: bool,
                   hopper_only: bool = False) -> str | None:
  """Why a stage's Mosaic GPU kernel cannot run this call, or None where it can.

  It runs where it takes the call's sizes and dtypes (`mosaic_supported`), compiled on
  Hopper or newer (`hopper_only`: on Hopper, sm_90, alone) or interpreted on a single
  device: Mosaic GPU's interpret mode keeps one shared-memory state per process and checks
  at the end of each kernel that no barrier is left in it, so kernels interpreted by
  several devices at once (a CPU mesh under kernel_sharding) fail that check.
  """
  if not mosaic_supported:
    return "it does not take these sizes and dtypes"
  if interpret:
    return None if jax.local_device_count() == 1 else "interpreted on several devices"
  major = compute_capability()[0]
  if major == 9 or (major > 9 and not hopper_only):
    return None
  return "it needs a Hopper GPU (sm_90)" if hopper_only else "it needs Hopper or newer"


def mosaic_or_triton(mosaic_supported: bool, interpret: bool,
                     hopper_only: bool = False) -> str:
  """"mosaic" where the stage's Mosaic GPU kernel runs the call (`mosaic_refusal`), else
  "triton"."""
  return "triton" if mosaic_refusal(mosaic_supported, interpret, hopper_only) else "mosaic"


def stage_backend(stage: str, backend: str, mosaic_supported: bool, interpret: bool,
                  hopper_only: bool = False) -> str:
  """The kernel ("triton" or "mosaic") that runs `stage` under `backend` (BACKENDS).

  Raises:
    NotImplementedError: backend="mosaic" where the stage's Mosaic kernel cannot run.
  """
  if backend == "triton":
    return "triton"
  refusal = mosaic_refusal(mosaic_supported, interpret, hopper_only)
  if backend == "mosaic" and refusal:
    raise NotImplementedError(f"the Mosaic GPU kernel of the {stage} cannot run: {refusal}")
  return "triton" if refusal else "mosaic"


def make_config(q, v, log_alpha, prior_precision, *, return_variance, chunk_size,
                interpret, k_dtype=None, beta_dtype=None,
                backend: str = "auto") -> GpuKernelConfig:
  """Checks what the kernel supports and picks tiles (k_dtype, beta_dtype: taken as
  q's and v's when not given) and each stage's kernel under `backend` (BACKENDS).

  Raises:
    ValueError: an unknown backend.
    NotImplementedError: K or V larger than MAX_DIM; backend="mosaic" where a stage's
      Mosaic GPU kernel cannot run the call.
  """
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  b, t, h, k = q.shape
  vdim = v.shape[-1]
  if k > MAX_DIM or vdim > MAX_DIM:
    raise NotImplementedError(
        f"palimpsa_gpu supports K, V <= {MAX_DIM}; got K={k}, V={vdim}")
  kp = round_up(k, DIM_MULTIPLE)
  chunk = next_power_of_two(max(16, min(chunk_size, t)))
  chunk = min(chunk, 128)
  vp = round_up(vdim, DIM_MULTIPLE)
  # Tiles chosen by sweeps (benchmarks/gpu_kernel_bench.py --sweep). Forward walk:
  # K-parts of 8-32 columns, about 256 state entries per part and warp. Boundary
  # kernel: one program per K-part of 16 or 32 columns (no padding) and V-tile of up
  # to 2048 entries, a warp per 512 entries. Backward walk: single-warp programs over
  # one [16, 16] state tile each (K cut into 16-column slices, no padding), sub-chunks
  # of 4 steps, the next sub-chunk's rows loaded a body ahead; at K=16, 8-column parts
  # over ~512 entries.
  largest = largest_power_of_two_dividing(kp)
  k_part = 8 if kp == 16 else min(largest, 32)
  # Two warps for 32-column parts, or where V lets the tile double.
  num_warps = 2 if (k_part == 32 or forward_block_v(vp, k_part, 2)
                    > forward_block_v(vp, k_part, 1)) else 1
  k_part_boundary = min(largest, 32)
  block_v_boundary = largest_block_v(vp, k_part_boundary, 2048, minimum=16)
  if kp == 16:
    k_part_bwd, k_split_bwd, block_v_bwd, groups_bwd = 8, 1, largest_block_v(vp, kp, 512), 1
  else:
    k_part_bwd, k_split_bwd, block_v_bwd, groups_bwd = 16, kp // 16, 16, vp // 16
  k_dtype, beta_dtype = k_dtype or q.dtype, beta_dtype or v.dtype
  bwd_row_dtypes = [q.dtype, k_dtype, v.dtype, beta_dtype, v.dtype]  # dO: out's dtype.
  if return_variance:
    bwd_row_dtypes.append(jnp.float32)
  sub = 4
  fwd_mosaic = walk_forward_mosaic.supported(
      chunk, kp, [k_dtype, q.dtype, v.dtype, beta_dtype], v.dtype, return_variance,
      interpret=interpret)
  bwd_mosaic = walk_backward_mosaic.supported(chunk, sub, bwd_row_dtypes, interpret=interpret)
  boundary_rows = jnp.float32 if v.dtype != beta_dtype else v.dtype
  mosaic_k_part = boundary_mosaic.default_k_part(kp)
  boundary_fwd = stage_backend(
      "boundary states", backend,
      boundary_mosaic.supported(chunk, mosaic_k_part, vp, k_dtype, boundary_rows,
                                interpret=interpret),
      interpret, hopper_only=True)
  if boundary_fwd == "mosaic":  # One wide K-part (the Triton kernel's rule is above).
    k_part_boundary = mosaic_k_part
  return GpuKernelConfig(
      b=b, t=t, h=h, k=k, v=vdim, chunk=chunk,
      block_v=forward_block_v(vp, k_part, num_warps),
      block_v_bwd=block_v_bwd,
      block_v_boundary=block_v_boundary,
      k_part=k_part, k_part_boundary=k_part_boundary, k_part_bwd=k_part_bwd,
      k_split_bwd=k_split_bwd, prefetch_bwd=kp > 16, unroll=2, sub=sub,
      groups_bwd=groups_bwd,
      num_warps=num_warps, num_warps_bwd=1,
      num_warps_boundary=max(1, block_v_boundary * k_part_boundary // 512),
      return_variance=return_variance,
      log_alpha_dtype=jnp.dtype(log_alpha.dtype).name,
      prior_dtype=jnp.dtype(prior_precision.dtype).name,
      interpret=interpret,
      boundary_fwd=boundary_fwd,
      walk_fwd=stage_backend("forward walk", backend, fwd_mosaic, interpret),
      walk_bwd=stage_backend("backward walk", backend, bwd_mosaic, interpret),
      carries_bwd=stage_backend("adjoint carries", backend, True, interpret),
      accumulate_bwd=not interpret and not deterministic_ops_requested())


def check_config(config: GpuKernelConfig, expected: GpuKernelConfig) -> None:
  """Raises ValueError where a given config's call fields differ from the call's."""
  for name in CALL_FIELDS:
    got, want = getattr(config, name), getattr(expected, name)
    if got != want:
      raise ValueError(f"config.{name} is {got!r}, but this call has {want!r}: build the "
                       "config with make_config from the same arguments.")
