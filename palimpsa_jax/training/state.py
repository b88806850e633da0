"""Train state: a pure pytree {"step", "params", "model_state", "opt_state"}.

The NNX model is split once into a static graphdef and its variables; the
parameters ("params") are trained, any other variables ("model_state") are
carried unchanged. Both are pure nested dicts of arrays, so Orbax saves them
as plain pytrees and `nnx.merge(graphdef, params, model_state)` rebuilds the
module inside jitted steps. Shapes come from `eval_shape`. The state is
created directly with its shardings, in one of two ways:

* on device: the whole initialiser is jitted with `out_shardings`, so no device
  ever holds an unsharded copy. Every parameter's random init becomes its own
  kernels, which is fast to compile for CPU but very slow for GPUs (hundreds
  of kernels, minutes for a 170M model).
* on host: the parameters are computed by a CPU-compiled function (about 1 s
  of CPU compile per layer), then each process places its addressable shards
  on its devices; only the optimizer state (zeros) is compiled for the
  accelerator. Each host holds the full float parameters once, transiently:
  fine up to a few billion parameters. The PRNG bits are those of the device
  path; float transforms of them (normal, truncated normal) may differ by an
  ulp between CPU and GPU, and are identical when both run on the CPU.
"""

from collections.abc import Callable
import dataclasses
from typing import Any, Literal

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
import ml_collections
import numpy as np
import optax

from palimpsa_jax import models
from palimpsa_jax.training import sharding as sharding_lib

InitOnHost = bool | Literal["auto"]


def run_model_fn(config: ml_collections.ConfigDict) -> models.ModelFn:
  """rngs -> the run config's NNX language model (config.model)."""
  return lambda rngs: models.build_model(config.model, rngs)


def _build(model_fn: models.ModelFn, seed: int) -> nnx.Module:
  # Shardings are applied by jit's out_shardings, not eagerly per variable.
  with nnx.use_eager_sharding(False):
    return model_fn(nnx.Rngs(seed))


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
  parts: models.ModelParts
  tx: optax.GradientTransformation
  shardings: dict
  abstract: dict
  init: Callable[[], dict]


def make_train_state_spec(model_fn: models.ModelFn, seed: int,
                          make_tx: Callable[[dict], optax.GradientTransformation],
                          mesh: Mesh, rules: sharding_lib.Rules,
                          init_on_host: InitOnHost = "auto") -> TrainStateSpec:
  """Shapes and shardings of the train state, and its sharded initialiser.

  Args:
    model_fn: rngs -> NNX module.
    seed: parameter initialisation seed.
    make_tx: abstract params (pure dict) -> optimizer.
    mesh: device mesh.
    rules: logical-axis rules.
    init_on_host: compute the initial parameters with a CPU-compiled function
      and copy them onto their shardings (True), or initialise everything in
      one function jitted for the mesh's devices (False). "auto": on host when
      the default backend is not CPU (GPU/TPU compile the per-parameter random
      init very slowly); on CPU the host path would only add a copy. Both draw
      the same random bits (see the module docstring). The host path needs the
      full float parameters in each host's memory.
  """
  use_host = resolve_init_on_host(init_on_host)
  parts = models.abstract_model(model_fn, seed)
  tx = make_tx(nnx.to_pure_dict(parts.abstract_params))
  shardings = train_state_shardings(parts, tx, mesh, rules)

  def build_variables():
    _, params, model_state = models.split_model(_build(model_fn, seed))
    return params, model_state

  def assemble(params, model_state):
    return {"step": jnp.zeros((), jnp.int32), "params": params,
            "model_state": model_state, "opt_state": tx.init(params)}

  if use_host:
    init = _host_initialiser(build_variables, assemble, shardings)
  else:
    init = jax.jit(lambda: assemble(*build_variables()), out_shardings=shardings)
  return TrainStateSpec(
      parts=parts, tx=tx, shardings=shardings,
      abstract=abstract_train_state(parts, tx, shardings), init=init)


def resolve_init_on_host(init_on_host: InitOnHost) -> bool:
  """Whether to initialise parameters on the host ("auto": off the CPU backend)."""
  if isinstance(init_on_host, bool):
    return init_on_host
  if init_on_host == "auto":
    return jax.default_backend() != "cpu"
  raise ValueError(
      f"init_on_host must be 'auto', True or False, got {init_on_host!r}.")


def _host_device() -> jax.Device:
  try:
    return jax.local_devices(backend="cpu")[0]
  except RuntimeError as error:
    raise ValueError(
        "init_on_host=True needs JAX's CPU backend; add 'cpu' to JAX_PLATFORMS "
        "or set init_on_host=False.") from error


def place_on_shardings(host_tree: Any, shardings: Any) -> Any:
  """Copies a host tree (full arrays, equal on every process) onto `shardings`.

  Each process transfers only its addressable shards, so this also works
  when the shardings span several processes.
  """
  def place(value, sharding):
    value = np.asarray(value)
    return jax.make_array_from_callback(
        value.shape, sharding, lambda index: value[index], dtype=value.dtype)

  return jax.tree.map(place, host_tree, shardings)


def _host_initialiser(build_variables: Callable[[], tuple[dict, dict]],
                      assemble: Callable[[dict, dict], dict],
                      shardings: dict) -> Callable[[], dict]:
  """() -> the train state: variables computed on the CPU, then sharded."""
  on_host = SingleDeviceSharding(_host_device())
  build_on_host = jax.jit(build_variables, out_shardings=on_host)
  fill = jax.jit(assemble, out_shardings=shardings, donate_argnums=(0, 1))

  def init():
    params, model_state = build_on_host()
    params, model_state = place_on_shardings(
        (params, model_state), (shardings["params"], shardings["model_state"]))
    return fill(params, model_state)

  return init


def train_state_shardings(parts: models.ModelParts, tx: optax.GradientTransformation,
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


def abstract_train_state(parts: models.ModelParts, tx: optax.GradientTransformation,
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
