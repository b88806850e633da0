"""MesaNet's state and what `mesa_net` returns."""

from typing import NamedTuple

import jax


class MesaState(NamedTuple):
  """The two gated sums of one head.

  kk: [B, H, K, K] float32, H = sum of gated beta k k^T (the data part of the precision).
  kv: [B, H, V, K] float32, G = sum of gated beta v k^T.
  """

  kk: jax.Array
  kv: jax.Array


class MesaNetResult(NamedTuple):
  """What `mesa_net` returns.

  out:   [B, T, H, V], dtype of v: readout G_t (H_t + diag lam)^{-1} q_t.
  state: MesaState after the last step.
  """

  out: jax.Array
  state: MesaState
