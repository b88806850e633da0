"""Argument checks for `gated_delta_rule`: clear errors naming the argument."""

from palimpsa_jax.ops.common import check_array, check_options, check_sequences
from palimpsa_jax.ops.gated_delta_rule import implementations
from pallas_kernels import dispatch

# The names `gated_delta_rule` accepts: "auto" and the table's.
IMPLEMENTATIONS = dispatch.names(implementations.IMPLEMENTATIONS)


def validate_gated_delta_args(q, k, v, beta, log_alpha, initial_state, segment_ids,
                              implementation: str, chunk_size: int
                              ) -> tuple[int, int, int, int, int]:
  """Checks every argument of `gated_delta_rule`; returns the sizes (B, T, H, K, V).

  Raises:
    TypeError, ValueError: as `palimpsa_jax.ops.common.check_array` and `check_options`.
  """
  sizes = check_sequences(q, k, v, initial_state, segment_ids)
  batch, time, heads = sizes[:3]
  check_array("beta", beta, (batch, time, heads), "[B, T, H]")
  check_array("log_alpha", log_alpha, (batch, time, heads), "[B, T, H]")
  check_options(implementation, chunk_size, implementations.IMPLEMENTATIONS)
  return sizes
