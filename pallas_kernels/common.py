"""Small helpers shared by the Pallas kernels (no dependency on palimpsa_jax)."""

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu_triton


def next_power_of_two(n: int) -> int:
  """Smallest power of two >= n (n >= 1)."""
  return 1 << max(0, (n - 1).bit_length())


def round_up(n: int, multiple: int) -> int:
  """Smallest multiple of `multiple` >= n."""
  return -(-n // multiple) * multiple


def fast_reciprocal(x: jax.Array, *, interpret: bool) -> jax.Array:
  """1/x for float32 x > 0 inside a Triton kernel (rcp.approx.ftz: <= 1 ulp).

  In interpret mode (CPU) the plain division is used.
  """
  if interpret:
    return 1.0 / x
  (y,) = plgpu_triton.elementwise_inline_asm(
      "rcp.approx.ftz.f32 $0, $1;",
      args=[x],
      constraints="=r,r",
      pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
  )
  return y
