"""Where the Fast Palimpsa kernels run: a Hopper GPU (or interpreted), chunks and states
that the boundary kernel takes."""

import jax
import jax.numpy as jnp

from pallas_kernels.common import round_up
from pallas_kernels.fast_palimpsa_gpu import states

f32 = jnp.float32


def hopper_available() -> bool:
  """Whether the default device is a CUDA GPU of compute capability 9.x (sm_90)."""
  version = str(getattr(jax.devices()[0], "compute_capability", "0.0"))
  return jax.devices()[0].platform == "gpu" and version.split(".")[0] == "9"


def check_supported(k, v, beta, chunk_size: int, interpret: bool) -> None:
  """Raises NotImplementedError with the reason where the kernel cannot run the call."""
  if not interpret and not hopper_available():
    raise NotImplementedError("the Mosaic GPU kernels need a Hopper (sm_90) GPU")
  kp, vp = round_up(k.shape[-1], 16), round_up(v.shape[-1], 16)
  x_dtype = v.dtype if v.dtype == beta.dtype else f32
  if not states.supported(chunk_size, kp, vp, k.dtype, x_dtype, interpret=interpret):
    raise NotImplementedError(
        f"chunk_size={chunk_size} with K={k.shape[-1]}, V={v.shape[-1]}: the kernel takes "
        f"chunks of 16, 32, 64 or 128 steps and states that fit its shared memory")
