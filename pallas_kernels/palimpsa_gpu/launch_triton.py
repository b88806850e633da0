"""How the op's Triton kernels are launched: their compiler parameters."""

from jax.experimental.pallas import triton as plgpu_triton


def triton_params(num_warps: int, interpret: bool, num_stages: int = 1):
  """A Triton kernel's compiler parameters; None in interpret mode (they do not apply)."""
  if interpret:
    return None
  return plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
