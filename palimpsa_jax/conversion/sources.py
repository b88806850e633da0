"""Reading a conversion source: our own train.py checkpoints or Hugging Face Mamba2."""

import dataclasses
import os
from typing import Any

import ml_collections

from palimpsa_jax import models
from palimpsa_jax.conversion import hf_mamba2
from palimpsa_jax.models import registry
from palimpsa_jax.training import checkpoint as checkpoint_lib



@dataclasses.dataclass(frozen=True)
class Source:
  """A pretrained model to convert.

  Attributes:
    params: parameter tree (pure nested dict of arrays, our layout).
    config: its model config (ml_collections, see models/config.py).
    kind: "orbax", "transformers" or "mamba_ssm".
    path: where it was read from.
    step: training step of an Orbax checkpoint (None for Hugging Face).
  """
  params: dict[str, Any]
  config: ml_collections.ConfigDict
  kind: str
  path: str
  step: int | None = None


def is_safetensors_source(path: str) -> bool:
  if path.endswith(".safetensors"):
    return True
  return os.path.isdir(path) and any(
      name.endswith(".safetensors") for name in os.listdir(path))


def load_source(path: str, *, num_groups: int | None = None,
                dtype: str | None = None) -> Source:
  """Reads `path`: a train.py workdir (or its checkpoints/<step>), or HF safetensors.

  Args:
    path: the source checkpoint.
    num_groups: B/C groups of a Hugging Face checkpoint whose config.json does
      not give them (default 1).
    dtype: compute dtype of the converted model; None keeps an Orbax source's
      and uses float32 for Hugging Face.

  Raises:
    ValueError: the model is not a Mamba2 / NotPalimpsa (or Palimpsa-M/D with
      unconverted layers) model.
  """
  if is_safetensors_source(path):
    params, config, layout = hf_mamba2.load_hf_mamba2(
        path, num_groups=num_groups, dtype=dtype or "float32")
    return Source(params, config, layout, path)
  model, run_config, step = checkpoint_lib.load_model(path)
  config = run_config.model
  # Conversion gives layers metaplasticity, which only the metaplastic kinds have.
  if config.mixer not in registry.METAPLASTIC_KINDS:
    raise ValueError(
        f"source {path!r} has mixer {config.mixer!r}; conversion needs one of "
        f"{registry.METAPLASTIC_KINDS} (Mamba2 or NotPalimpsa models)")
  if dtype is not None:
    config.dtype = dtype
  _, params, _ = models.split_model(model)
  return Source(params, config, "orbax", path, step)
