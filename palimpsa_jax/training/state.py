"""Train state: a pure pytree {"step", "params", "model_state", "opt_state"}.

The NNX model is split once into a static graphdef and its variables; the
parameters ("params") are trained, any other variables ("model_state") are
carried unchanged. Both are pure nested dicts of arrays, so Orbax saves them
as plain pytrees and `nnx.merge(graphdef, params, model_state)` rebuilds the
module inside jitted steps. The state is created directly with its shardings:
shapes come from `eval_shape`, and the initialiser is jitted with
`out_shardings`, so no device ever holds an unsharded copy.
"""

from collections.abc import Callable
import dataclasses
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
import optax

from palimpsa_jax.training import sharding as sharding_lib

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


def _build(model_fn: ModelFn, seed: int) -> nnx.Module:
  # Shardings are applied by jit's out_shardings, not eagerly per variable.
  with nnx.use_eager_sharding(False):
    return model_fn(nnx.Rngs(seed))


def split_model(model: nnx.Module) -> tuple[Any, dict, dict]:
  """(graphdef, params pure dict, other variables pure dict)."""
  graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
  return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(model_state)


def abstract_model(model_fn: ModelFn, seed: int = 0) -> ModelParts:
  """Shapes and structure of the model without allocating it."""
  with nnx.use_eager_sharding(False):
    model = nnx.eval_shape(lambda: model_fn(nnx.Rngs(seed)))
  graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
  return ModelParts(graphdef, params, model_state)


def merge_model(graphdef: Any, params: dict, model_state: dict) -> nnx.Module:
  """The NNX module holding `params` and `model_state`."""
  return nnx.merge(graphdef, params, model_state)


def match_param_shardings(abstract_tree: Any, param_shardings: dict,
                          abstract_params: dict, default: NamedSharding) -> Any:
  """Shardings for a tree whose sub-trees copy the parameters (optimizer moments).

  A leaf whose key path ends with a parameter's path and whose shape equals that
  parameter's gets the parameter's sharding; every other leaf gets `default`.
  """
  by_path = {}
  for path, sharding in jax.tree_util.tree_leaves_with_path(param_shardings):
    by_path[tuple(path)] = sharding
  shapes = {tuple(path): leaf.shape for path, leaf in
            jax.tree_util.tree_leaves_with_path(abstract_params)}

  def pick(path, leaf):
    path = tuple(path)
    for length in range(len(path), 0, -1):
      suffix = path[-length:]
      if suffix in by_path and shapes[suffix] == leaf.shape:
        return by_path[suffix]
    return default

  return jax.tree_util.tree_map_with_path(pick, abstract_tree)


@dataclasses.dataclass(frozen=True)
class TrainStateSpec:
  """Everything needed to create, restore and step a sharded train state.

  Attributes:
    parts: the split model.
    tx: the optimizer.
    shardings: NamedSharding of every train-state leaf.
    abstract: ShapeDtypeStructs (with shardings) of the train state.
    init: () -> a freshly initialised train state, created sharded.
  """
  parts: ModelParts
  tx: optax.GradientTransformation
  shardings: dict
  abstract: dict
  init: Callable[[], dict]


def make_train_state_spec(model_fn: ModelFn, seed: int,
                          make_tx: Callable[[dict], optax.GradientTransformation],
                          mesh: Mesh, rules: sharding_lib.Rules) -> TrainStateSpec:
  """Shapes and shardings of the train state, and its sharded initialiser.

  Args:
    model_fn: rngs -> NNX module.
    seed: parameter initialisation seed.
    make_tx: abstract params (pure dict) -> optimizer.
    mesh: device mesh.
    rules: logical-axis rules.
  """
  parts = abstract_model(model_fn, seed)
  tx = make_tx(nnx.to_pure_dict(parts.abstract_params))
  shardings = train_state_shardings(parts, tx, mesh, rules)

  def init():
    _, params, model_state = split_model(_build(model_fn, seed))
    return {"step": jnp.zeros((), jnp.int32), "params": params,
            "model_state": model_state, "opt_state": tx.init(params)}

  return TrainStateSpec(
      parts=parts, tx=tx, shardings=shardings,
      abstract=abstract_train_state(parts, tx, shardings),
      init=jax.jit(init, out_shardings=shardings))


def train_state_shardings(parts: ModelParts, tx: optax.GradientTransformation,
                          mesh: Mesh, rules: sharding_lib.Rules) -> dict:
  """Shardings of every leaf of the train state."""
  replicated = sharding_lib.replicated(mesh)
  params = nnx.to_pure_dict(parts.abstract_params)
  param_shardings = sharding_lib.state_shardings(parts.abstract_params, mesh, rules)
  abstract_opt = jax.eval_shape(tx.init, params)
  return {
      "step": replicated,
      "params": param_shardings,
      "model_state": sharding_lib.state_shardings(
          parts.abstract_model_state, mesh, rules),
      "opt_state": match_param_shardings(abstract_opt, param_shardings, params,
                                         replicated),
  }


def abstract_train_state(parts: ModelParts, tx: optax.GradientTransformation,
                         shardings: dict) -> dict:
  """ShapeDtypeStructs (with shardings) of the train state: restore targets."""
  params = nnx.to_pure_dict(parts.abstract_params)
  abstract = {
      "step": jax.ShapeDtypeStruct((), jnp.int32),
      "params": params,
      "model_state": nnx.to_pure_dict(parts.abstract_model_state),
      "opt_state": jax.eval_shape(tx.init, params),
  }
  return jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract, shardings)
