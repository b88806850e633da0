"""Per-step pieces shared by the forward and backward kernels.

State tiles are [Kp, BV]: keys on sublanes, a 128-lane tile of values on lanes. A chunk's q, k
([Kp, C]) and per-step gates ([1, C]) arrive with time on lanes, so step t selects one lane of
those; v, beta and the output cotangents ([C, BV], float32) arrive with time on sublanes, so step t
reads one row.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def lane_mask(shape: tuple[int, int], t: jax.Array) -> jax.Array:
  """[X, C] boolean mask of lane (time step) t, shared by the lane accesses of a step."""
  return jax.lax.broadcasted_iota(jnp.int32, shape, 1) == t


def column(x_t: jax.Array, mask: jax.Array) -> jax.Array:
  """The masked column of a [X, C] block as [X, 1]: a lane select and a lane reduction."""
  return jnp.sum(jnp.where(mask, x_t, 0.0), axis=1, keepdims=True)


def put_column(acc: jax.Array, col: jax.Array, mask: jax.Array) -> jax.Array:
  """acc [X, C] with its masked column replaced by col [X, 1]."""
  return jnp.where(mask, col, acc)


def row(ref, t: jax.Array) -> jax.Array:
  """Row t of a [1, C, X] float32 block ref as a [1, X] value."""
  return ref[0, pl.ds(t, 1), :]


def advance(m, ibar, a, k_col, v_row, beta_row):
  """M = a M + k v^T and Ibar = a Ibar + k^2 beta^T on [Kp, BV] tiles.

  a [1, 1]; k_col [Kp, 1]; v_row, beta_row [1, BV].
  """
  m = a * m + k_col * v_row
  ibar = a * ibar + (k_col * k_col) * beta_row
  return m, ibar
