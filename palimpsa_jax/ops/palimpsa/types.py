"""Containers shared by every Palimpsa implementation."""

from typing import NamedTuple

import jax
import jax.numpy as jnp


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


def initial_mean_and_precision(initial_state: PalimpsaState | None, ip: jax.Array, batch: int,
                               value_dim: int, key_dim: int) -> tuple[jax.Array, jax.Array]:
  """(mu0, precision0), each [B, H, V, K] float32: the given state, or the prior (0, Ip).

  ip: [H] float32 prior precision.
  """
  if initial_state is None:
    heads = ip.shape[0]
    mu0 = jnp.zeros((batch, heads, value_dim, key_dim), jnp.float32)
    prec0 = jnp.broadcast_to(ip[None, :, None, None], mu0.shape)
    return mu0, prec0
  return (initial_state.mu.astype(jnp.float32),
          initial_state.precision.astype(jnp.float32))
