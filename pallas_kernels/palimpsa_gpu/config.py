"""`GpuKernelConfig`: the static configuration of one palimpsa_gpu call, and what the choice
of each stage's kernel depends on.

The first fields describe the call (sizes, dtypes, mode) and follow from its arguments;
the rest are the kernels' tiles and choices, which `stages.make_config` gathers from the stage
modules. A caller may pass a config of its own (e.g. `dataclasses.replace(make_config(...),
...)` with other tiles) to `palimpsa_gpu`, which checks that its call fields match the call.

Each of the four stages (boundary states, forward walk, backward walk, adjoint carries)
has a Triton kernel and a Mosaic GPU kernel. `backend` chooses between them: "auto" takes
Mosaic per stage where it runs the call, "triton" and "mosaic" one backend for every stage.
This module holds the rule (`stage_backend`) and the device facts it reads; each stage module
says what its kernel supports and which tiles it takes, and `stages` holds the table of them.
"""

import dataclasses
import os
import re
from typing import Any, NamedTuple

import jax

from pallas_kernels.common import next_power_of_two, round_up

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
      each call's scratch and partial sums take at most this many bytes
      (`stages.walk_pieces`).
    boundary_fwd: "mosaic" (boundary_mosaic: tensor cores through wgmma, Hopper sm_90
      only) or "triton" (boundary_triton, with the tiles above).
    walk_fwd: "mosaic" (walk_forward_mosaic: Hopper and newer, K <= 128) or "triton"
      (walk_forward_triton, with the tiles above).
    walk_bwd: "mosaic" (walk_backward_mosaic: Hopper and newer, rows that fit shared memory) or
      "triton" (walk_backward_triton, with the tiles above).
    carries_bwd: "mosaic" (carries_mosaic: Hopper and newer) or "triton" (carries_triton).
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


class StageCall(NamedTuple):
  """What a stage's kernel choice and tiles depend on.

  chunk: steps per chunk; kp, vp: K and V padded to multiples of 16; q_dtype, k_dtype,
  v_dtype, beta_dtype: the rows' dtypes (the readouts and their cotangents take v's);
  with_var: whether the variance is returned; interpret: Pallas interpret mode.
  """

  chunk: int
  kp: int
  vp: int
  q_dtype: Any
  k_dtype: Any
  v_dtype: Any
  beta_dtype: Any
  with_var: bool
  interpret: bool


def largest_block_v(v_padded: int, k_padded: int, elements: int, minimum: int = 1) -> int:
  """V-tile: the largest power of two dividing v_padded with <= `elements` per tile."""
  bv = next_power_of_two(v_padded)
  while bv > minimum and (v_padded % bv or bv * k_padded > elements):
    bv //= 2
  return bv


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


def check_config(config: GpuKernelConfig, expected: GpuKernelConfig) -> None:
  """Raises ValueError where a given config's call fields differ from the call's."""
  for name in CALL_FIELDS:
    got, want = getattr(config, name), getattr(expected, name)
    if got != want:
      raise ValueError(f"config.{name} is {got!r}, but this call has {want!r}: build the "
                       "config with make_config from the same arguments.")
