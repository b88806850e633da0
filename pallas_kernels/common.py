"""Small helpers shared by the Pallas kernels and the XLA implementations (no dependency on
palimpsa_jax)."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton


def step_gates(log_alpha: jax.Array, starts: jax.Array | None) -> jax.Array:
  """The per-step gates a_t = exp(log_alpha_t) in float32, 0 where a segment starts at t.

  Every Palimpsa implementation builds its gates with this rule, in its own layout:
  restarting from the prior is M = 0, Ibar = 0 in the linear form, which a zero gate does.
  starts: bool, broadcastable to log_alpha, or None (no restarts).
  """
  a = jnp.exp(log_alpha.astype(jnp.float32))
  if starts is None:
    return a
  return jnp.where(starts, 0.0, a)


def next_power_of_two(n: int) -> int:
  """Smallest power of two >= n (n >= 1)."""
  return 1 << max(0, (n - 1).bit_length())


def round_up(n: int, multiple: int) -> int:
  """Smallest multiple of `multiple` >= n."""
  return -(-n // multiple) * multiple


def largest_power_of_two_dividing(n: int) -> int:
  """The largest power of two that divides n (n >= 1)."""
  return n & -n


def k_parts(width: int, k_part: int) -> list[pl.Slice]:
  """Static slices cutting an axis [0, width) into equal parts of k_part columns.

  Triton tensors have power-of-two shapes: a K of 48 is walked as 3 parts of 16
  instead of being padded to 64.
  """
  return [pl.ds(i * k_part, k_part) for i in range(width // k_part)]


def bf16_terms(y: jax.Array, n: int = 3) -> list[jax.Array]:
  """float32 y as n bfloat16 terms, largest first, whose sum is y to about 8n bits.

  Three terms carry float32's 24: a product of an exactly-bfloat16 x with y then runs
  as three bfloat16 tensor-core products (exact, float32 accumulation).
  """
  terms = []
  for _ in range(n):
    t = y.astype(jnp.bfloat16)
    terms.append(t)
    y = y - t.astype(jnp.float32)
  return terms


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


def fma(x, y, z, *, interpret: bool) -> jax.Array:
  """x * y + z in float32 with one rounding (fma.rn) inside a Triton kernel.

  The Triton pipeline here does not contract multiplies and adds into FMAs on its own
  (Nsight Compute counted no fused FP32 instructions in these kernels), so the state
  updates ask for them. Arguments broadcast against each other; in interpret mode (CPU)
  the plain expression is used.
  """
  if interpret:
    return x * y + z
  shape = jnp.broadcast_shapes(jnp.shape(x), jnp.shape(y), jnp.shape(z))
  args = [jnp.broadcast_to(jnp.asarray(a, jnp.float32), shape) for a in (x, y, z)]
  (out,) = plgpu_triton.elementwise_inline_asm(
      "fma.rn.f32 $0, $1, $2, $3;",
      args=args,
      constraints="=r,r,r,r",
      pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)],
  )
  return out
