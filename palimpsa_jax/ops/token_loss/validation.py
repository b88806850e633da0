"""Argument checks for `token_loss` and `logits_token_loss`: one-line errors naming the argument."""

import jax.numpy as jnp

from palimpsa_jax.ops.common import check_array
from palimpsa_jax.ops.token_loss.implementations import IMPLEMENTATIONS
from pallas_kernels import dispatch


def _check_rank(name: str, x, ndim: int, layout: str) -> None:
  if getattr(x, "ndim", None) != ndim:
    raise ValueError(f"{name} must be an array of shape {layout}, got "
                     f"{getattr(x, 'shape', type(x).__name__)}.")


def _check_targets_and_weights(targets, weights, positions: tuple[int, int]) -> None:
  check_array("targets", targets, positions, "[B, T]", kind="int")
  if weights is None:
    return
  if not hasattr(weights, "dtype"):
    raise TypeError(f"weights must be an array of shape [B, T], got {type(weights).__name__}.")
  if weights.dtype != jnp.bool_:
    check_array("weights", weights, positions, "[B, T] (bool or float)")
  elif tuple(weights.shape) != positions:
    raise ValueError(f"weights must have shape [B, T] = {positions}, got {tuple(weights.shape)}.")


def validate_token_loss_args(h, table, targets, weights, implementation: str) -> None:
  """Checks every argument of `token_loss`.

  Raises:
    TypeError, ValueError: naming the argument and what was expected.
  """
  _check_rank("h", h, 3, "[B, T, d]")
  check_array("h", h, h.shape, "[B, T, d]")
  _check_rank("table", table, 2, "[vocab, d]")
  check_array("table", table, (table.shape[0], h.shape[-1]), "[vocab, d] (d of h)")
  if table.dtype != h.dtype:
    raise TypeError(f"table must have h's dtype {h.dtype}, got {table.dtype}.")
  _check_targets_and_weights(targets, weights, tuple(h.shape[:2]))
  dispatch.check_name(implementation, IMPLEMENTATIONS)


def validate_logits_args(logits, targets, weights) -> None:
  """Checks every argument of `logits_token_loss`."""
  _check_rank("logits", logits, 3, "[B, T, vocab]")
  check_array("logits", logits, logits.shape, "[B, T, vocab]")
  _check_targets_and_weights(targets, weights, tuple(logits.shape[:2]))
