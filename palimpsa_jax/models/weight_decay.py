"""Which parameters get weight decay."""

from collections.abc import Sequence
from typing import Any

import jax

from palimpsa_jax.models.paths import path_names

NO_DECAY_NAMES = frozenset(
    {"A_log", "dt_bias", "D", "b_scale", "Ip_log", "lam_raw", "bias"})


def decays(names: Sequence[str]) -> bool:
  """False for A_log, dt_bias, D, b_scale, Ip_log, lam_raw, biases and norm scales."""
  if not names:
    return True
  if names[-1] in NO_DECAY_NAMES:
    return False
  return not any("norm" in name for name in names)


def weight_decay_mask(params: Any) -> Any:
  """Pytree of bools with the structure of `params` (nnx.State or dict).

  Usable as optax.adamw(mask=weight_decay_mask).
  """
  return jax.tree_util.tree_map_with_path(
      lambda path, _: decays(path_names(path)), params)
