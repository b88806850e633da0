"""Argument checks for `simple_gla`: clear errors naming the argument."""

from palimpsa_jax.ops.common import check_array, check_options, check_sequences
from palimpsa_jax.ops.simple_gla import implementations


def validate_gla_args(q, k, v, log_alpha, initial_state, segment_ids, implementation: str,
                      chunk_size: int) -> tuple[int, int, int, int, int]:
  """Checks every argument of `simple_gla`; returns the sizes (B, T, H, K, V).

  Raises:
    TypeError, ValueError: as `palimpsa_jax.ops.common.check_array` and `check_options`.
  """
  sizes = check_sequences(q, k, v, initial_state, segment_ids)
  check_array("log_alpha", log_alpha, sizes[:3], "[B, T, H]")
  check_options(implementation, chunk_size, implementations.IMPLEMENTATIONS)
  return sizes
