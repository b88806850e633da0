"""Input checks shared by the mixers."""

import jax
import jax.numpy as jnp


def check_mixer_input(x: jax.Array, d_model: int) -> None:
  """Raises ValueError/TypeError unless x is [B, T, d_model] floating point."""
  if x.ndim != 3 or x.shape[-1] != d_model:
    raise ValueError(f"x must be [B, T, {d_model}], got shape {x.shape}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"x must be floating point, got {x.dtype}")
