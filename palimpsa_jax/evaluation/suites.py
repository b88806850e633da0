"""Evaluation suites for eval.py: name -> run(options) -> JSON-able dict."""

from collections.abc import Callable, Mapping
import importlib
from typing import Any

from palimpsa_jax.run_config import base
from palimpsa_jax.run_config import values

Suite = Callable[[Mapping[str, Any]], dict[str, Any]]

# What the suites' numeric options accept (eval.py checks its flags of these names with them).
OPTION_FIELDS = {
    "max_length": base.FIELDS["seq_len"],  # The row length, as the run's seq_len.
    "batch_size": values.positive(),
    "num_examples": values.positive(),
    "mesh_sequence": values.positive(),
    "limit": values.positive(kind=float),
}

# Modules are imported on first use: a suite's dependencies (lm-eval, ...)
# are needed only when that suite runs.
_MODULES = {
    "mqar": "palimpsa_jax.evaluation.mqar",
    "lm": "palimpsa_jax.evaluation.lm",
    "long_context": "palimpsa_jax.evaluation.long_context",
    "commonsense": "palimpsa_jax.evaluation.commonsense",
}


class _LazySuites(Mapping):
  """Mapping of suite names to their `run` functions, imported lazily."""

  def __getitem__(self, name: str) -> Suite:
    if name not in _MODULES:
      raise KeyError(f"unknown suite {name!r}; suites: {sorted(_MODULES)}")
    return importlib.import_module(_MODULES[name]).run

  def __iter__(self):
    return iter(_MODULES)

  def __len__(self):
    return len(_MODULES)


SUITES: Mapping[str, Suite] = _LazySuites()
