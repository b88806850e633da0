"""The kernels of each stage, and `make_config`, which picks one per stage.

KERNELS holds, per stage, its modules by backend in the order "auto" prefers them; each stage
picks by pallas_kernels.dispatch's rule, the ops' own. Every stage module has the same parts:
  supports(call: StageCall) -> str | None: None where its kernel runs the call (sizes, dtypes,
    device), else why not;
  a tiles dataclass (frozen, named after the module, e.g. BoundaryMosaicTiles) naming its
    backend (ClassVar `backend`, its key in KERNELS[stage]); the boundary states' and the
    backward walk's also give their K width (`k_width`), the backward walk's the width it
    takes the boundary states at (`starts_k_width`);
  tiles(call): the tiles it takes for the call, an instance of that dataclass;
  launch(cfg, *arrays, ...): its kernel with cfg's tiles for its stage, the same arguments
    for every module of a stage.
The backward walks also say how much temporary memory a call takes (temp_bytes). A new kernel
for a stage is its module and its row in KERNELS[stage].
"""

import types

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch
from pallas_kernels.common import next_power_of_two, round_up
from pallas_kernels.palimpsa_gpu import (boundary_mosaic, boundary_triton, carries_mosaic,
                                         carries_triton, config, walk_backward_mosaic,
                                         walk_backward_triton, walk_forward_mosaic,
                                         walk_forward_triton)
from pallas_kernels.palimpsa_gpu.config import STAGES, GpuKernelConfig, StageCall

KERNELS: dict[str, dict[str, types.ModuleType]] = {
    "boundary_fwd": {"mosaic": boundary_mosaic, "triton": boundary_triton},
    "walk_fwd": {"mosaic": walk_forward_mosaic, "triton": walk_forward_triton},
    "walk_bwd": {"mosaic": walk_backward_mosaic, "triton": walk_backward_triton},
    "carries_bwd": {"mosaic": carries_mosaic, "triton": carries_triton},
}
# Every backend of some stage's kernel: what `backend` may name besides "auto" (each stage's
# first kernel that runs the call).
_BACKENDS = dict.fromkeys(name for kernels in KERNELS.values() for name in kernels)
BACKENDS = dispatch.names(_BACKENDS)


def run(stage: str, cfg: GpuKernelConfig, *args, **kwargs):
  """The kernel cfg names for `stage` (a key of KERNELS), launched with cfg's tiles."""
  return KERNELS[stage][getattr(cfg, stage).backend].launch(cfg, *args, **kwargs)


def walk_pieces(cfg: GpuKernelConfig) -> int:
  """Backward walk calls: the fewest dividing B*H whose temporaries each take at most
  cfg.max_walk_temp_bytes."""
  bh = cfg.b * cfg.h
  per_head = KERNELS["walk_bwd"][cfg.walk_bwd.backend].temp_bytes(cfg)
  pieces = 1
  while pieces < bh and (bh % pieces or per_head * bh // pieces > cfg.max_walk_temp_bytes):
    pieces += 1
  return pieces


def stage_backend(stage: str, backend: str, call: StageCall) -> str:
  """The backend whose kernel runs `stage` for the call under `backend` (BACKENDS).

  Raises:
    NotImplementedError: a named backend that has no kernel for the stage, or whose kernel
      cannot run the call (naming the stage and why).
  """
  kernels = KERNELS[stage]
  if backend not in dispatch.names(kernels):
    raise NotImplementedError(f"the {STAGES[stage]} has no {backend} kernel")
  return dispatch.choose(
      kernels, backend, tuple(kernels), call,
      refuse=lambda name, reason: NotImplementedError(
          f"the {name} kernel of the {STAGES[stage]} cannot run: {reason}"))


def make_config(q, v, log_alpha, prior_precision, *, return_variance, chunk_size,
                interpret, k_dtype=None, beta_dtype=None,
                backend: str = "auto") -> GpuKernelConfig:
  """Checks what the kernel supports and picks each stage's kernel under `backend`
  (BACKENDS) and its tiles (k_dtype, beta_dtype: taken as q's and v's when not given).

  Raises:
    ValueError: an unknown backend.
    NotImplementedError: K or V larger than MAX_DIM; a named backend whose kernel of a stage
      cannot run the call.
  """
  dispatch.check_name(backend, _BACKENDS, argument="backend")
  b, t, h, k = q.shape
  vdim = v.shape[-1]
  if k > config.MAX_DIM or vdim > config.MAX_DIM:
    raise NotImplementedError(
        f"palimpsa_gpu supports K, V <= {config.MAX_DIM}; got K={k}, V={vdim}")
  chunk = min(next_power_of_two(max(16, min(chunk_size, t))), 128)
  call = StageCall(chunk=chunk, kp=round_up(k, config.DIM_MULTIPLE),
                   vp=round_up(vdim, config.DIM_MULTIPLE), q_dtype=q.dtype,
                   k_dtype=k_dtype or q.dtype, v_dtype=v.dtype,
                   beta_dtype=beta_dtype or v.dtype, with_var=return_variance,
                   interpret=interpret, capability=config.compute_capability(),
                   devices=jax.local_device_count())
  tiles = {stage: KERNELS[stage][stage_backend(stage, backend, call)].tiles(call)
           for stage in STAGES}
  return GpuKernelConfig(
      b=b, t=t, h=h, k=k, v=vdim, chunk=chunk, return_variance=return_variance,
      log_alpha_dtype=jnp.dtype(log_alpha.dtype).name,
      prior_dtype=jnp.dtype(prior_precision.dtype).name, interpret=interpret,
      accumulate_bwd=not interpret and not config.deterministic_ops_requested(), **tiles)
