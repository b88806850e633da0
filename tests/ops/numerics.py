"""Numerical helpers shared by the op tests: float64 relative error and float64 inputs."""

import jax.numpy as jnp
import numpy as np


def rel_error(x, ref) -> float:
  """max |x - ref| / max |ref| in float64."""
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


def to_float64(inputs) -> list:
  """(*floats, segment_ids) -> float64 jax arrays (call inside enable_x64), ids unchanged."""
  *floats, seg = inputs
  return [jnp.asarray(np.asarray(x, np.float64)) for x in floats] + [jnp.asarray(seg)]
