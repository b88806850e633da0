"""Argument checks for `fast_palimpsa`: `palimpsa`'s array checks
(ops.palimpsa_contract) plus its own options."""

from palimpsa_jax.ops.common import check_options
from palimpsa_jax.ops.fast_palimpsa.implementations import IMPLEMENTATIONS
from palimpsa_jax.ops.palimpsa_contract import check_palimpsa_arrays


def validate_fast_palimpsa_args(q, k, v, beta, log_alpha, prior_precision, initial_state,
                                segment_ids, implementation: str, chunk_size: int
                                ) -> tuple[int, int, int, int, int]:
  """Checks every argument of `fast_palimpsa`; returns the sizes (B, T, H, K, V).

  Raises:
    TypeError: an argument has the wrong type or dtype.
    ValueError: wrong rank, mismatched B/T/H/K/V, empty time axis, bad chunk_size or
      unknown implementation.
  """
  check_options(implementation, chunk_size, IMPLEMENTATIONS)
  return check_palimpsa_arrays(q, k, v, beta, log_alpha, prior_precision, initial_state,
                               segment_ids)
