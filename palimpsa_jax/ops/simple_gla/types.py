"""What `simple_gla` returns."""

from typing import NamedTuple

import jax


class SimpleGLAResult(NamedTuple):
  """What `simple_gla` returns.

  out:   [B, T, H, V], dtype of v: readout h_t q_t.
  state: [B, H, V, K] float32, h after the last step.
  """

  out: jax.Array
  state: jax.Array
