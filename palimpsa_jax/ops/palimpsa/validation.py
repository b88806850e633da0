"""Argument checks for `palimpsa`: clear errors naming the argument and what was expected."""

from palimpsa_jax.ops.common import check_array, check_options, check_sequences
from palimpsa_jax.ops.palimpsa import implementations
from palimpsa_jax.ops.palimpsa.types import PalimpsaState

# The names `palimpsa` accepts: "auto" and the table's.
IMPLEMENTATIONS = ("auto", *implementations.IMPLEMENTATIONS)


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
  check_options(implementation, chunk_size, IMPLEMENTATIONS)
  return check_palimpsa_arrays(q, k, v, beta, log_alpha, prior_precision, initial_state,
                               segment_ids)


def check_palimpsa_arrays(q, k, v, beta, log_alpha, prior_precision, initial_state,
                          segment_ids) -> tuple[int, int, int, int, int]:
  """The array arguments of `palimpsa` (shared with ops that take the same inputs);
  returns (B, T, H, K, V). Raises TypeError/ValueError naming the argument."""
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
