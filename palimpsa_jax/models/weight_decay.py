"""Which parameters get weight decay."""

from typing import Any

import jax

NO_DECAY_NAMES = frozenset(
    {"A_log", "dt_bias", "D", "b_scale", "Ip_log", "bias"})


def _path_names(path) -> list[str]:
  names = []
  for entry in path:
    for attr in ("key", "name", "idx"):
      if hasattr(entry, attr):
        names.append(str(getattr(entry, attr)))
        break
  return [n for n in names if n != "value"]


def decays(path_names: list[str]) -> bool:
  """False for A_log, dt_bias, D, b_scale, Ip_log, biases and norm scales."""
  if not path_names:
    return True
  if path_names[-1] in NO_DECAY_NAMES:
    return False
  return not any("norm" in name for name in path_names)


def weight_decay_mask(params: Any) -> Any:
  """Pytree of bools with the structure of `params` (nnx.State or dict).

  Usable as optax.adamw(mask=weight_decay_mask).
  """
  return jax.tree_util.tree_map_with_path(
      lambda path, _: decays(_path_names(path)), params)
