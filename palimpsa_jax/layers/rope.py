"""Rotary position embeddings (half-split layout)."""

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, positions: jax.Array,
               theta: float = 10000.0) -> jax.Array:
  """Rotates x [B, T, H, D] by positions [B, T] or [T]; D must be even."""
  head_dim = x.shape[-1]
  if head_dim % 2:
    raise ValueError(f"RoPE needs an even head dim, got x.shape={x.shape}")
  half = head_dim // 2
  freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions.astype(jnp.float32)[..., None] * freqs  # [(B,) T, D/2]
  if angles.ndim == 2:
    angles = angles[None]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  xf = x.astype(jnp.float32)
  x1, x2 = xf[..., :half], xf[..., half:]
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
  return rotated.astype(x.dtype)
