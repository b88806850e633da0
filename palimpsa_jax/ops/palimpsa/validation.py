"""Argument checks for `palimpsa`: clear errors naming the argument and what was expected."""

from typing import Any

import jax.numpy as jnp

from palimpsa_jax.ops.palimpsa.types import PalimpsaState

IMPLEMENTATIONS = ("auto", "sequential", "associative", "chunked", "pallas_gpu", "pallas_tpu")


def _check_float(name: str, x: Any) -> None:
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise TypeError(f"{name} must be a jax/numpy array, got {type(x).__name__}.")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must have a floating dtype (float32, bfloat16, ...), got {x.dtype}.")


def _check_shape(name: str, x: Any, expected: tuple[int, ...], layout: str) -> None:
  if tuple(x.shape) != tuple(expected):
    raise ValueError(f"{name} must have shape {layout} = {tuple(expected)}, got {tuple(x.shape)}.")


def validate_palimpsa_args(
    q, k, v, beta, log_alpha, prior_precision, initial_state, segment_ids,
    implementation: str, chunk_size: int,
) -> tuple[int, int, int, int, int]:
  """Checks every argument of `palimpsa`; returns the sizes (B, T, H, K, V).

  Raises:
    TypeError: an argument has the wrong type or a non-float (integer: segment_ids) dtype.
    ValueError: wrong rank, mismatched B/T/H/K/V, empty time axis, bad chunk_size or
      unknown implementation.
  """
  if not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}.")
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
    raise TypeError(f"chunk_size must be a positive Python int, got {chunk_size!r}.")
  if chunk_size <= 0:
    raise ValueError(f"chunk_size must be a positive int, got {chunk_size}.")

  for name, x in (("q", q), ("k", k), ("v", v), ("log_alpha", log_alpha),
                  ("prior_precision", prior_precision)):
    _check_float(name, x)
  if q.ndim != 4:
    raise ValueError(f"q must have rank 4 [B, T, H, K], got shape {tuple(q.shape)}.")
  b, t, h, kd = q.shape
  if t == 0:
    raise ValueError(f"q must have at least one time step [B, T>=1, H, K], got {tuple(q.shape)}.")
  _check_shape("k", k, (b, t, h, kd), "[B, T, H, K]")
  if v.ndim != 4 or tuple(v.shape[:3]) != (b, t, h):
    raise ValueError(
        f"v must have shape [B, T, H, V] with (B, T, H) = {(b, t, h)} from q, "
        f"got {tuple(v.shape)}.")
  vd = v.shape[3]
  if beta is not None:
    _check_float("beta", beta)
    _check_shape("beta", beta, (b, t, h, vd), "[B, T, H, V]")
  _check_shape("log_alpha", log_alpha, (b, t, h), "[B, T, H]")
  _check_shape("prior_precision", prior_precision, (h,), "[H]")

  if initial_state is not None:
    if not isinstance(initial_state, PalimpsaState):
      raise TypeError(
          f"initial_state must be a PalimpsaState or None, got {type(initial_state).__name__}.")
    for name, x in (("initial_state.mu", initial_state.mu),
                    ("initial_state.precision", initial_state.precision)):
      _check_float(name, x)
      _check_shape(name, x, (b, h, vd, kd), "[B, H, V, K]")

  if segment_ids is not None:
    if not hasattr(segment_ids, "dtype") or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise TypeError(
          f"segment_ids must be an integer array [B, T], got "
          f"{getattr(segment_ids, 'dtype', type(segment_ids).__name__)}.")
    _check_shape("segment_ids", segment_ids, (b, t), "[B, T]")
  return b, t, h, kd, vd
