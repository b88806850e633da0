"""Argument checks for `mesa_net`: clear errors naming the argument."""

from palimpsa_jax.ops.common import check_array, check_options, check_sequences
from palimpsa_jax.ops.mesa_net import implementations


def validate_mesa_args(q, k, v, beta, log_gamma, lam, initial_state, segment_ids,
                       implementation: str, chunk_size: int, cg_steps: int
                       ) -> tuple[int, int, int, int, int]:
  """Checks every argument of `mesa_net`; returns the sizes (B, T, H, K, V).

  Raises:
    TypeError, ValueError: as `palimpsa_jax.ops.common.check_array` and `check_options`;
      ValueError for cg_steps that is not a non-negative int.
  """
  sizes = check_sequences(q, k, v, None, segment_ids)
  batch, time, heads, key_dim, value_dim = sizes
  check_array("beta", beta, (batch, time, heads), "[B, T, H]")
  check_array("log_gamma", log_gamma, (batch, time, heads), "[B, T, H]")
  check_array("lam", lam, (heads, key_dim), "[H, K]")
  if initial_state is not None:
    check_array("initial_state.kk", initial_state.kk, (batch, heads, key_dim, key_dim),
                "[B, H, K, K]")
    check_array("initial_state.kv", initial_state.kv, (batch, heads, value_dim, key_dim),
                "[B, H, V, K]")
  check_options(implementation, chunk_size, implementations.IMPLEMENTATIONS)
  if isinstance(cg_steps, bool) or not isinstance(cg_steps, int) or cg_steps < 0:
    raise ValueError(f"cg_steps must be a non-negative int, got {cg_steps!r}.")
  return sizes
