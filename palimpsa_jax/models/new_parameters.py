"""The parameters a metaplastic layer adds to its Mamba2 / NotPalimpsa counterpart.

A converted model (conversion/surgery.py) starts them from their initialisers;
fine-tuning can train them alone first (training/optimizer.py).
"""

from collections.abc import Sequence
from typing import Any

import jax

from palimpsa_jax.models.paths import path_names

NEW_PARAMETER_NAMES = ("beta_down", "beta_up", "b_scale", "Ip_log")


def is_new_parameter(names: Sequence[str]) -> bool:
  """Whether the parameter at these path names is one of NEW_PARAMETER_NAMES' kind."""
  return any(name in NEW_PARAMETER_NAMES for name in names)


def new_parameter_mask(params: Any) -> Any:
  """True for the metaplastic parameters (beta_down, beta_up, b_scale, Ip_log)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: is_new_parameter(path_names(path)), params)
