"""RMSNorm and the gated RMSNorm used at the output of every recurrent mixer."""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from palimpsa_jax.layers import params as params_lib


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
  """x / rms(x) over the last axis, computed in float32."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x / ||x|| over the last axis, computed in float32, returned in x.dtype."""
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)
  return y.astype(x.dtype)


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis with a learned scale (init 1)."""

  def __init__(
      self, features: int, *, eps: float = 1e-5,
      names: Sequence[str | None] = ("embed",), dtype=jnp.float32):
    self.scale = params_lib.make_param(jnp.ones((features,)), names)
    self.eps = eps
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., features] -> [..., features] in `dtype`."""
    return (rms_normalize(x, self.eps) * self.scale[...]).astype(self.dtype)


class GatedRMSNorm(nnx.Module):
  """RMSNorm over groups of the last axis, gated by swish(gate).

  norm_before_gate=True (FLA / Gated DeltaNet style):
    y = rmsnorm(x) * scale * silu(gate)
  norm_before_gate=False (Mamba2 style, norm after gating):
    y = rmsnorm(x * silu(gate)) * scale
  The mean square is taken over contiguous groups of `group_size` features.
  """

  def __init__(
      self, features: int, *, group_size: int | None = None,
      norm_before_gate: bool = True, eps: float = 1e-5,
      names: Sequence[str | None] = ("kv",), dtype=jnp.float32):
    group_size = group_size or features
    if features % group_size:
      raise ValueError(
          f"group_size {group_size} must divide features {features}")
    self.scale = params_lib.make_param(jnp.ones((features,)), names)
    self.group_size = group_size
    self.norm_before_gate = norm_before_gate
    self.eps = eps
    self.dtype = dtype

  def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
    """x, gate [..., features] -> [..., features] in `dtype`."""
    x = x.astype(jnp.float32)
    gate = jax.nn.silu(gate.astype(jnp.float32))
    if not self.norm_before_gate:
      x = x * gate
    shape = x.shape
    grouped = x.reshape(*shape[:-1], shape[-1] // self.group_size,
                        self.group_size)
    y = rms_normalize(grouped, self.eps).reshape(shape) * self.scale[...]
    if self.norm_before_gate:
      y = y * gate
    return y.astype(self.dtype)
