"""Containers shared by every Palimpsa implementation."""

from typing import NamedTuple

import jax


class PalimpsaState(NamedTuple):
  """Posterior over the memory of each (batch, head).

  mu:        [B, H, V, K] float32, posterior mean of the memory matrix.
  precision: [B, H, V, K] float32, per-entry precision I (importance), > 0.
  """

  mu: jax.Array
  precision: jax.Array


class PalimpsaResult(NamedTuple):
  """What `palimpsa` returns.

  out:      [B, T, H, V], dtype of v: readout mu_t q_t.
  variance: [B, T, H, V] float32 predictive variance sum_k q^2 / I_t, or None.
  state:    PalimpsaState after the last step.
  """

  out: jax.Array
  variance: jax.Array | None
  state: PalimpsaState
