"""What `palimpsa` and its approximation `fast_palimpsa` share: the state and result types,
the checks of their array arguments, and their implementations' contract.

Every entry of either op's IMPLEMENTATIONS is called as

    fn(q, k, v, beta, log_alpha, prior_precision, initial_mu, initial_precision,
       segment_starts, *, return_variance, chunk_size, interpret)
    -> (out [B, T, H, V] dtype of v, variance [B, T, H, V] float32 or None,
        mu [B, H, V, K] float32, precision [B, H, V, K] float32)

on validated arrays: q, k [B, T, H, K]; v, beta [B, T, H, V]; log_alpha [B, T, H];
prior_precision [H] float32; (initial_mu, initial_precision) [B, H, V, K] float32, the state
before step 0 in PalimpsaState's form; segment_starts [B, T] bool (True where the state
restarts from the prior) or None. The Pallas kernels among them run per device shard with
`kernel_layouts`.
"""

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from palimpsa_jax.ops.common import check_array, check_sequences


class PalimpsaState(NamedTuple):
  """Posterior over the memory of each (batch, head).

  mu:        [B, H, V, K] float32, posterior mean of the memory matrix.
  precision: [B, H, V, K] float32, per-entry precision I (importance), > 0.
  """

  mu: jax.Array
  precision: jax.Array


class PalimpsaResult(NamedTuple):
  """What `palimpsa` (and `fast_palimpsa`) returns.

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


def check_palimpsa_arrays(q, k, v, beta, log_alpha, prior_precision, initial_state,
                          segment_ids) -> tuple[int, int, int, int, int]:
  """The array arguments of `palimpsa` and `fast_palimpsa`; returns (B, T, H, K, V).

  Raises TypeError/ValueError naming the argument.
  """
  b, t, h, kd, vd = check_sequences(q, k, v, None, segment_ids)
  if beta is not None:
    check_array("beta", beta, (b, t, h, vd), "[B, T, H, V]")
  check_array("log_alpha", log_alpha, (b, t, h), "[B, T, H]")
  check_array("prior_precision", prior_precision, (h,), "[H]")
  if initial_state is not None:
    if not isinstance(initial_state, PalimpsaState):
      raise TypeError(
          f"initial_state must be a PalimpsaState or None, got {type(initial_state).__name__}.")
    for name, x in (("initial_state.mu", initial_state.mu),
                    ("initial_state.precision", initial_state.precision)):
      check_array(name, x, (b, h, vd, kd), "[B, H, V, K]")
  return b, t, h, kd, vd


def kernel_layouts(options: Mapping[str, Any]) -> tuple[tuple[str, ...], tuple[str | None, ...]]:
  """The contract's operands and outputs in ops.kernel_sharding's layouts (no variance output
  unless options["return_variance"])."""
  return (("b.h.", "b.h.", "b.h.", "b.h.", "b.h", "h", "bh..", "bh..", "b."),
          ("b.h.", "b.h." if options["return_variance"] else None, "bh..", "bh.."))
