"""A model as its parts: a static graphdef, its parameters and its other variables.

Parameters ("params") and other variables ("model_state") are pure nested dicts
of arrays, so Orbax saves them as plain pytrees and `merge_model` rebuilds the
module (also inside jitted functions). Shapes come from `nnx.eval_shape`.
"""

from collections.abc import Callable
import dataclasses
from typing import Any

from flax import nnx
import jax
from jax.sharding import SingleDeviceSharding

ModelFn = Callable[[nnx.Rngs], nnx.Module]


@dataclasses.dataclass(frozen=True)
class ModelParts:
  """The static pieces of a split model.

  Attributes:
    graphdef: nnx graph definition (static structure of the module).
    abstract_params: nnx.State of the trained parameters (ShapeDtypeStructs,
      with their sharding metadata).
    abstract_model_state: nnx.State of every other variable.
  """
  graphdef: Any
  abstract_params: nnx.State
  abstract_model_state: nnx.State


def split_model(model: nnx.Module) -> tuple[Any, dict, dict]:
  """(graphdef, params pure dict, other variables pure dict)."""
  graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
  return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(model_state)


def merge_model(graphdef: Any, params: dict, model_state: dict) -> nnx.Module:
  """The NNX module holding `params` and `model_state`."""
  return nnx.merge(graphdef, params, model_state)


def abstract_model(model_fn: ModelFn, seed: int = 0) -> ModelParts:
  """Shapes and structure of the model without allocating it."""
  with nnx.use_eager_sharding(False):
    model = nnx.eval_shape(lambda: model_fn(nnx.Rngs(seed)))
  graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
  return ModelParts(graphdef, params, model_state)


def abstract_on_first_local_device(parts: ModelParts) -> dict[str, Any]:
  """The model's abstract {"params", "model_state"} pure dicts on the first local device.

  The restore target of a model loaded on one device (evaluation, conversion).
  """
  device = SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
      {"params": nnx.to_pure_dict(parts.abstract_params),
       "model_state": nnx.to_pure_dict(parts.abstract_model_state)})
