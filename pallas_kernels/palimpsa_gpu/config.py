"""`GpuKernelConfig`: the static configuration of one palimpsa_gpu call, and the facts each
stage's choice of kernel reads.

The config holds the call's fields (sizes, dtypes, mode), which follow from its arguments, and
one tiles object per stage: an instance of the tiles dataclass of the stage module that runs
it (e.g. boundary_mosaic.BoundaryMosaicTiles), which names its backend and holds that kernel's
tiles. `stages.make_config` builds it (each stage's kernel chosen by the rule of
pallas_kernels.dispatch, its tiles from its module). A caller may pass a config of its own to
`palimpsa_gpu` (e.g. `dataclasses.replace(make_config(...), walk_bwd=...)` with other tiles or
another kernel for a stage), which checks that its call fields match the call.
"""

import dataclasses
import os
import re
from typing import Any, ClassVar, NamedTuple, Protocol

import jax

from pallas_kernels.common import next_power_of_two, round_up

MAX_DIM = 256
DIM_MULTIPLE = 16  # K and V are padded to multiples of 16 (tensor-core tiles).
# The fields of GpuKernelConfig that describe the call rather than tune the kernels.
CALL_FIELDS = ("b", "t", "h", "k", "v", "chunk", "return_variance", "log_alpha_dtype",
               "prior_dtype", "interpret")
# GpuKernelConfig's field holding each stage's tiles, and the stage's name in messages, in the
# order the kernel runs them.
STAGES = {"boundary_fwd": "boundary states", "walk_fwd": "forward walk",
          "walk_bwd": "backward walk", "carries_bwd": "adjoint carries"}


class StageTiles(Protocol):
  """What every stage module's tiles dataclass (frozen, its kernel's tiles) says."""

  backend: ClassVar[str]  # The stage module's backend: its key in stages.KERNELS[stage].


@dataclasses.dataclass(frozen=True)
class GpuKernelConfig:
  """Static configuration of one call.

  Call fields (from the arguments):
    b, t, h, k, v: batch, time steps, heads, key and value widths.
    chunk: steps per chunk, a power of two in [16, 128].
    return_variance: whether the variance is returned.
    log_alpha_dtype, prior_dtype: dtype names of log_alpha and prior_precision (their
      gradients').
    interpret: whether the kernels run in Pallas interpret mode.

  Each stage's kernel and tiles (its module's tiles dataclass, named after the module):
    boundary_fwd: boundary states (boundary_triton or boundary_mosaic: its K width is
      `k_boundary`).
    walk_fwd: forward walk (walk_forward_triton or walk_forward_mosaic).
    walk_bwd: backward walk (walk_backward_triton or walk_backward_mosaic: its K width is
      `k_bwd`).
    carries_bwd: adjoint carries (carries_triton or carries_mosaic).

  Mode fields:
    max_walk_temp_bytes: the backward walk is called on slices of batch*head so that
      each call's scratch and partial sums take at most this many bytes
      (`stages.walk_pieces`).
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
  return_variance: bool
  log_alpha_dtype: str
  prior_dtype: str
  interpret: bool
  boundary_fwd: StageTiles
  walk_fwd: StageTiles
  walk_bwd: StageTiles
  carries_bwd: StageTiles
  max_walk_temp_bytes: int = 2 << 30
  accumulate_bwd: bool = False

  @property
  def backends(self) -> tuple[str, ...]:
    """Each stage's backend, in STAGES' order."""
    return tuple(getattr(self, stage).backend for stage in STAGES)

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
    """K width of the boundary kernel and of the states it writes."""
    return self.boundary_fwd.k_width(self.k + self.k_pad)

  @property
  def k_bwd(self) -> int:
    """K width of the backward walk."""
    return self.walk_bwd.k_width(self.k + self.k_pad)


class StageCall(NamedTuple):
  """What a stage's kernel choice and tiles depend on.

  chunk: steps per chunk; kp, vp: K and V padded to multiples of 16; q_dtype, k_dtype,
  v_dtype, beta_dtype: the rows' dtypes (the readouts and their cotangents take v's);
  with_var: whether the variance is returned; interpret: Pallas interpret mode;
  capability: the default device's (major, minor) compute capability, (0, 0) where it is not
  a CUDA GPU; devices: the local device count.
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
  capability: tuple[int, int]
  devices: int


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


def mosaic_refusal(supported: bool, call: StageCall, hopper_only: bool = False) -> str | None:
  """Why a stage's Mosaic GPU kernel cannot run this call, or None where it can (the
  `supports` of every Mosaic stage module).

  It runs where it takes the call's sizes and dtypes (`supported`), compiled on Hopper or
  newer (`hopper_only`: on Hopper, sm_90, alone) or interpreted on a single device: Mosaic
  GPU's interpret mode keeps one shared-memory state per process and checks at the end of
  each kernel that no barrier is left in it, so kernels interpreted by several devices at once
  (a CPU mesh under kernel_sharding) fail that check.
  """
  if not supported:
    return "it does not take these sizes and dtypes"
  if call.interpret:
    return None if call.devices == 1 else "interpreted on several devices"
  major = call.capability[0]
  if major == 9 or (major > 9 and not hopper_only):
    return None
  return "it needs a Hopper GPU (sm_90)" if hopper_only else "it needs Hopper or newer"


def check_config(config: GpuKernelConfig, expected: GpuKernelConfig) -> None:
  """Raises ValueError where a given config's call fields differ from the call's."""
  for name in CALL_FIELDS:
    got, want = getattr(config, name), getattr(expected, name)
    if got != want:
      raise ValueError(f"config.{name} is {got!r}, but this call has {want!r}: build the "
                       "config with make_config from the same arguments.")
