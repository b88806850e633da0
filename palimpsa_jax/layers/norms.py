"""RMSNorm and the gated RMSNorm used at the output of every recurrent mixer."""

from collections.abc import Callable, Sequence
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from palimpsa_jax.layers import params as params_lib


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
  """x / rms(x) over the last axis, computed in float32."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


# The norms recompute their float32 internals in the backward from their input (often
# bfloat16, and kept anyway by the matmul or op that produced it): autodiff of the float32
# forward kept the normalised x in float32, twice the bytes of a bfloat16 input.
def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x / ||x|| over the last axis, computed in float32, returned in x.dtype."""
  return _l2_normalize(x, eps)


@functools.partial(jax.checkpoint, static_argnums=(1,))
def _l2_normalize(x: jax.Array, eps: float) -> jax.Array:
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
    return _rms_norm(x, self.scale[...], self.eps, jnp.dtype(self.dtype))


@functools.partial(jax.checkpoint, static_argnums=(2, 3))
def _rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype: jnp.dtype) -> jax.Array:
  """RMSNorm's output in dtype; the backward keeps x and recomputes the rest."""
  return (rms_normalize(x, eps) * scale).astype(dtype)


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
    return gated_rms_norm(x, gate, self.scale[...], self.group_size, self.eps,
                          self.norm_before_gate, jnp.dtype(self.dtype))


def projected_gated_norm(norm: GatedRMSNorm, projection: Callable[[jax.Array], jax.Array],
                         x: jax.Array, gate: jax.Array) -> jax.Array:
  """projection(norm(x, gate)) with the heads' features joined: x, gate [B, T, H, V] ->
  projection's output of [B, T, H * V].

  The backward keeps x and gate (in the compute dtype) and recomputes the norm's output,
  which the projection's weight gradient needs; the projection's forward is not rerun.
  """
  def run(x, gate):
    y = norm(x, gate)
    return projection(y.reshape(*y.shape[:-2], -1))

  return jax.checkpoint(run)(x, gate)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def gated_rms_norm(x: jax.Array, gate: jax.Array, scale: jax.Array, group_size: int,
                   eps: float, norm_before_gate: bool, dtype: jnp.dtype) -> jax.Array:
  """GatedRMSNorm's output [..., F] in dtype from x, gate [..., F] and scale [F] f32.

  Computed in float32. The custom VJP recomputes the per-group statistics from
  x and gate instead of keeping float32 intermediates: autodiff of the
  forward kept silu(gate), the normalised x and their products as full-size
  float32 arrays and read them back in separate passes.
  """
  return _gated_norm_parts(x, gate, scale, group_size, eps, norm_before_gate)[0].astype(dtype)


def _grouped(x, group_size):
  return x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)


def _gated_norm_parts(x, gate, scale, group_size, eps, norm_before_gate):
  """(y f32 [..., F], the normalised input zhat [..., G, S], its rsqrt [..., G, 1],
  silu(gate) f32 [..., F])."""
  silu = jax.nn.silu(gate.astype(jnp.float32))
  z = x.astype(jnp.float32)
  if not norm_before_gate:
    z = z * silu
  z = _grouped(z, group_size)
  inv_rms = jax.lax.rsqrt(jnp.mean(z * z, axis=-1, keepdims=True) + eps)
  zhat = z * inv_rms
  y = zhat.reshape(x.shape) * scale
  if norm_before_gate:
    y = y * silu
  return y, zhat, inv_rms, silu


def _gated_rms_norm_fwd(x, gate, scale, group_size, eps, norm_before_gate, dtype):
  return gated_rms_norm(x, gate, scale, group_size, eps, norm_before_gate, dtype), (
      x, gate, scale)


def _gated_rms_norm_bwd(group_size, eps, norm_before_gate, dtype, residuals, dy):
  del dtype
  x, gate, scale = residuals
  _, zhat, inv_rms, silu = _gated_norm_parts(x, gate, scale, group_size, eps,
                                             norm_before_gate)
  dy = dy.astype(jnp.float32)
  shape = x.shape
  normed = zhat.reshape(shape)
  # d(loss)/d(zhat * scale) and d(loss)/d(scale).
  d_normed = dy * silu if norm_before_gate else dy
  d_scale = jnp.sum((d_normed * normed).reshape(-1, shape[-1]), axis=0)
  d_zhat = _grouped(d_normed * scale, group_size)
  # Through zhat = z / rms(z): dz = (d_zhat - zhat * mean(d_zhat * zhat)) / rms(z).
  dz = (inv_rms * (d_zhat - zhat * jnp.mean(d_zhat * zhat, axis=-1, keepdims=True))
        ).reshape(shape)
  gate_f32 = gate.astype(jnp.float32)
  sigmoid = jax.nn.sigmoid(gate_f32)
  d_silu_d_gate = sigmoid * (1.0 + gate_f32 * (1.0 - sigmoid))
  if norm_before_gate:
    dx = dz
    d_gate = dy * normed * scale * d_silu_d_gate
  else:
    dx = dz * silu
    d_gate = dz * x.astype(jnp.float32) * d_silu_d_gate
  return dx.astype(x.dtype), d_gate.astype(gate.dtype), d_scale.astype(scale.dtype)


gated_rms_norm.defvjp(_gated_rms_norm_fwd, _gated_rms_norm_bwd)
