"""Per-step pieces shared by the forward and backward kernels.

State tiles are [Kp, BV]: keys on sublanes, a 128-lane tile of values on lanes. A chunk's q and k
arrive transposed ([Kp, C], time on lanes); v, beta and the per-step gate arrive with time on
sublanes ([C, BV] and [C, 1]), so step t reads one row of those.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def lane_mask(shape: tuple[int, int], t: jax.Array) -> jax.Array:
  """[Kp, C] boolean mask of lane (time step) t, shared by every column access of a step."""
  return jax.lax.broadcasted_iota(jnp.int32, shape, 1) == t


def column(x_t: jax.Array, mask: jax.Array) -> jax.Array:
  """The masked column of a [Kp, C] block as [Kp, 1]: a lane select and a lane reduction."""
  return jnp.sum(jnp.where(mask, x_t, 0.0), axis=1, keepdims=True)


def put_column(acc: jax.Array, col: jax.Array, mask: jax.Array) -> jax.Array:
  """acc [Kp, C] with its masked column replaced by col [Kp, 1]."""
  return jnp.where(mask, col, acc)


def row(ref, t: jax.Array) -> jax.Array:
  """Row t of a [1, C, X] block ref as a float32 [1, X] value."""
  return ref[0, pl.ds(t, 1), :].astype(jnp.float32)


def advance(m, ibar, a, k_col, v_row, beta_row):
  """M = a M + k v^T and Ibar = a Ibar + k^2 beta^T on [Kp, BV] tiles.

  a [1, 1]; k_col [Kp, 1]; v_row, beta_row [1, BV].
  """
  m = a * m + k_col * v_row
  ibar = a * ibar + (k_col * k_col) * beta_row
  return m, ibar
