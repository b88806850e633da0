"""Dense projection with logical sharding names."""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from palimpsa_jax.layers import params as params_lib


class Dense(nnx.Module):
  """y = x @ kernel (+ bias); kernel [in, out] float32, computed in `dtype`."""

  def __init__(
      self, in_features: int, out_features: int, *,
      names: Sequence[str | None], rngs: nnx.Rngs,
      kernel_init: params_lib.Initializer | None = None,
      use_bias: bool = False,
      bias_init: params_lib.Initializer | None = None,
      dtype: jnp.dtype = jnp.float32):
    kernel_init = kernel_init or params_lib.normal_init()
    self.kernel = params_lib.make_param(
        kernel_init(rngs.params(), (in_features, out_features), jnp.float32),
        names)
    if use_bias:
      bias = (bias_init(rngs.params(), (out_features,), jnp.float32)
              if bias_init else jnp.zeros((out_features,), jnp.float32))
      self.bias = params_lib.make_param(bias, names[-1:])
    else:
      self.bias = None
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., in] -> [..., out] in `dtype`."""
    y = jnp.matmul(x.astype(self.dtype), self.kernel[...].astype(self.dtype))
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return y
