"""Argument checks for `palimpsa`: clear errors naming the argument and what was expected."""

from palimpsa_jax.ops.common import check_options
from palimpsa_jax.ops.palimpsa import implementations
from palimpsa_jax.ops.palimpsa_contract import check_palimpsa_arrays
from pallas_kernels import dispatch

# The names `palimpsa` accepts: "auto" and the table's.
IMPLEMENTATIONS = dispatch.names(implementations.IMPLEMENTATIONS)


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
  check_options(implementation, chunk_size, implementations.IMPLEMENTATIONS)
  return check_palimpsa_arrays(q, k, v, beta, log_alpha, prior_precision, initial_state,
                               segment_ids)
