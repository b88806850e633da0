"""The kernel of each stage on each Pallas backend, and `make_config`, which picks among them.

Every stage module of KERNELS has the same four parts:
  supports_call(call: StageCall) -> bool: whether its kernel takes the call's sizes and dtypes;
  tiles(call) -> dict: the GpuKernelConfig fields it reads, chosen from the sizes;
  launch(cfg, *arrays, ...): its kernel with cfg's tiles, the same arguments on both
    backends of a stage;
and each Mosaic GPU one says which GPUs it needs (HOPPER_ONLY: sm_90 alone, else sm_90 and
newer). The backward walks also say how much temporary memory a call takes (temp_bytes).
"""

import types

import jax.numpy as jnp

from pallas_kernels.common import next_power_of_two, round_up
from pallas_kernels.palimpsa_gpu import (boundary_mosaic, boundary_triton, carries_mosaic,
                                         carries_triton, config, walk_backward_mosaic,
                                         walk_backward_triton, walk_forward_mosaic,
                                         walk_forward_triton)
from pallas_kernels.palimpsa_gpu.config import GpuKernelConfig, StageCall

# GpuKernelConfig's field naming each stage's backend, and the stage's name in messages, in
# the order the stages are chosen.
STAGES = {"boundary_fwd": "boundary states", "walk_fwd": "forward walk",
          "walk_bwd": "backward walk", "carries_bwd": "adjoint carries"}
KERNELS: dict[tuple[str, str], types.ModuleType] = {
    ("boundary_fwd", "triton"): boundary_triton,
    ("boundary_fwd", "mosaic"): boundary_mosaic,
    ("walk_fwd", "triton"): walk_forward_triton,
    ("walk_fwd", "mosaic"): walk_forward_mosaic,
    ("walk_bwd", "triton"): walk_backward_triton,
    ("walk_bwd", "mosaic"): walk_backward_mosaic,
    ("carries_bwd", "triton"): carries_triton,
    ("carries_bwd", "mosaic"): carries_mosaic,
}


def run(stage: str, cfg: GpuKernelConfig, *args, **kwargs):
  """The kernel cfg names for `stage` (a key of STAGES), launched with cfg's tiles."""
  return KERNELS[stage, getattr(cfg, stage)].launch(cfg, *args, **kwargs)


def walk_pieces(cfg: GpuKernelConfig) -> int:
  """Backward walk calls: the fewest dividing B*H whose temporaries each take at most
  cfg.max_walk_temp_bytes."""
  bh = cfg.b * cfg.h
  per_head = KERNELS["walk_bwd", cfg.walk_bwd].temp_bytes(cfg)
  pieces = 1
  while pieces < bh and (bh % pieces or per_head * bh // pieces > cfg.max_walk_temp_bytes):
    pieces += 1
  return pieces


def make_config(q, v, log_alpha, prior_precision, *, return_variance, chunk_size,
                interpret, k_dtype=None, beta_dtype=None,
                backend: str = "auto") -> GpuKernelConfig:
  """Checks what the kernel supports and picks each stage's kernel under `backend`
  (config.BACKENDS) and the tiles (k_dtype, beta_dtype: taken as q's and v's when not given).

  Every tile field takes the Triton kernel's value (so that a config can switch a stage to
  Triton); a stage that runs on Mosaic GPU then overrides the fields it reads.

  Raises:
    ValueError: an unknown backend.
    NotImplementedError: K or V larger than MAX_DIM; backend="mosaic" where a stage's
      Mosaic GPU kernel cannot run the call.
  """
  if backend not in config.BACKENDS:
    raise ValueError(f"backend must be one of {config.BACKENDS}, got {backend!r}")
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
                   interpret=interpret)
  fields = {}
  for stage, name in STAGES.items():
    mosaic = KERNELS[stage, "mosaic"]
    fields.update(KERNELS[stage, "triton"].tiles(call))
    fields[stage] = config.stage_backend(name, backend, mosaic.supports_call(call), interpret,
                                         hopper_only=mosaic.HOPPER_ONLY)
    if fields[stage] == "mosaic":
      fields.update(mosaic.tiles(call))
  return GpuKernelConfig(
      b=b, t=t, h=h, k=k, v=vdim, chunk=chunk, return_variance=return_variance,
      log_alpha_dtype=jnp.dtype(log_alpha.dtype).name,
      prior_dtype=jnp.dtype(prior_precision.dtype).name, interpret=interpret,
      accumulate_bwd=not interpret and not config.deterministic_ops_requested(), **fields)
