"""What the gated delta rule returns."""

from typing import NamedTuple

import jax


class GatedDeltaRuleResult(NamedTuple):
  """What `gated_delta_rule` returns.

  out:   [B, T, H, V], dtype of v: readout S_t q_t.
  state: [B, H, V, K] float32, S after the last step.
  """

  out: jax.Array
  state: jax.Array
