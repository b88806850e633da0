"""Turning chosen layers of a Mamba2 / NotPalimpsa model metaplastic (docs/models.md, conversion).

Every source weight is copied; the converted layers gain beta_down, beta_up,
b_scale and Ip_log. init="paper" keeps the layers' own initialisers (docs/models.md,
layers: beta_down ~ N(0, 0.02), beta_up ~ U(+-r^-1/2), b_scale 1, Ip_log 0);
init="zero" sets b_scale so low that softplus(b_scale) is exactly 0 in float32,
so beta == 0 and the model computes the source function exactly (Ip = 1). The
metaplastic branch then has zero gradient in every new parameter, so a "zero"
conversion can never learn metaplasticity: it is an equivalence check of the
conversion, not a starting point for fine-tuning (configs/finetune.py rejects
it); "paper" is the fine-tuning initialisation.
"""

from collections.abc import Sequence
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections

from palimpsa_jax import models
from palimpsa_jax.conversion.sources import Source

INITS = ("paper", "zero")
# softplus(-1e4) and its derivative underflow to exactly 0 in float32.
ZERO_INIT_B_SCALE = -1e4


def converted_config(config: ml_collections.ConfigDict,
                     layers: Sequence[int]) -> ml_collections.ConfigDict:
  """The source model config with `layers` added to config.metaplastic_layers."""
  new = ml_collections.ConfigDict(config.to_dict())
  new.metaplastic_layers = tuple(
      sorted(set(models.metaplastic_layers(config)) | set(layers)))
  return new


def check_layers(layers: Sequence[int], config: ml_collections.ConfigDict) -> None:
  """Raises ValueError for out-of-range, repeated or already metaplastic layers."""
  if len(set(layers)) != len(layers):
    raise ValueError(f"layers {list(layers)} contain repeats")
  bad = [i for i in layers if not 0 <= i < config.num_layers]
  if bad:
    raise ValueError(f"layers {bad} out of range [0, {config.num_layers})")
  done = sorted(set(layers) & set(models.metaplastic_layers(config)))
  if done:
    raise ValueError(f"layers {done} are already metaplastic in the source")


def _leaves(tree: dict[str, Any]) -> dict[tuple[str, ...], Any]:
  return {models.path_names(path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def convert(source: Source, layers: Sequence[int], init: str = "paper",
            seed: int = 0) -> tuple[nnx.Module, ml_collections.ConfigDict]:
  """(converted NNX model, its model config) with `layers` made metaplastic."""
  if init not in INITS:
    raise ValueError(f"init must be one of {INITS}, got {init!r}")
  layers = [int(i) for i in layers]
  check_layers(layers, source.config)
  config = converted_config(source.config, layers)
  graphdef, params, model_state = models.split_model(
      models.build_model(config, nnx.Rngs(seed)))
  target = _leaves(params)
  given = _leaves(source.params)
  unknown = sorted(set(given) - set(target), key=str)
  if unknown:
    raise ValueError(f"source parameters with no place in the converted model: {unknown}")
  for path, value in given.items():
    if tuple(value.shape) != tuple(target[path].shape):
      raise ValueError(
          f"source parameter {'/'.join(map(str, path))} has shape {value.shape}, "
          f"the converted model expects {target[path].shape}")
  uncovered = sorted((p for p in set(target) - set(given)
                      if not models.is_new_parameter(p)), key=str)
  if uncovered:
    raise ValueError(f"converted-model parameters missing from the source: {uncovered}")

  converted = {str(i) for i in layers}

  def pick(path, leaf):
    key = models.path_names(path)
    if key in given:
      return jnp.asarray(given[key], jnp.float32)
    if init == "zero" and key[-1] == "b_scale" and key[1] in converted:
      return jnp.full_like(leaf, ZERO_INIT_B_SCALE)
    return leaf

  params = jax.tree_util.tree_map_with_path(pick, params)
  return models.merge_model(graphdef, params, model_state), config
