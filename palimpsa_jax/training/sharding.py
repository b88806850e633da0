"""Device mesh and logical-axis sharding rules.

The mesh has the axes ("data", "fsdp", "sequence", "tensor"). Parameters carry
logical axis names ("vocab", "embed", "heads", "kv", "mlp", "rank", "conv",
"layers", None) in their `out_sharding` metadata; the rules below map each name
to a mesh axis. "length", the time axis of the batch and the activations, maps
to "sequence": a size above 1 splits every sequence over that many devices
(context parallelism, ops.context_parallel).
A dimension that the mapped mesh axes do not divide stays replicated, so tiny
models still run on many devices.

`mesh_context` builds the mesh, its rules and the kernel context from a config's mesh
section in one call; training, evaluation and the benchmarks all place their steps with it
or with the pieces it is made of.
"""

from collections.abc import Callable, Sequence
import contextlib
import functools
import math
from typing import Any, NamedTuple

from flax import nnx
import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from palimpsa_jax.ops import kernel_sharding
from palimpsa_jax.run_config import base

MESH_AXES = ("data", "fsdp", "sequence", "tensor")
BATCH_AXES = ("data", "fsdp")

# Logical name -> mesh axis (or None: replicated). FSDP shards the model width,
# tensor parallelism the vocabulary, heads and MLP hidden units.
DEFAULT_RULES = (
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("kv", None),
    ("rank", None),
    ("conv", None),
    ("layers", None),  # The stacked axis of scan_layers models.
    ("length", "sequence"),  # Time, in the batch and the mixers' activations.
)

Rules = Sequence[tuple[str, str | None]]


def mesh_shape(config: ml_collections.ConfigDict, num_devices: int) -> tuple[int, ...]:
  """Sizes of MESH_AXES from config; one -1 takes the remaining devices.

  An axis missing from config (e.g. "sequence" in an older config) has size 1.
  """
  sizes = [int(config.get(axis, 1)) for axis in MESH_AXES]
  if any(s == 0 or s < -1 for s in sizes):
    raise base.ConfigError(
        f"config.mesh sizes must be positive or -1, got "
        f"{dict(zip(MESH_AXES, sizes))}.")
  if sizes.count(-1) > 1:
    raise base.ConfigError(
        f"at most one config.mesh axis may be -1, got {dict(zip(MESH_AXES, sizes))}.")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise base.ConfigError(
          f"config.mesh {dict(zip(MESH_AXES, sizes))}: {num_devices} devices "
          f"are not a multiple of {known}.")
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise base.ConfigError(
        f"config.mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} "
        f"devices, but {num_devices} are available.")
  return tuple(sizes)


def validate_sequence_axis(config: ml_collections.ConfigDict, seq_len: int) -> None:
  """Raises base.ConfigError unless config's sequence axis can split seq_len-token sequences.

  The axis must divide seq_len, and lie on one host (each host feeds whole sequences).
  """
  sizes = dict(zip(MESH_AXES, mesh_shape(config, jax.device_count())))
  if sizes["sequence"] == 1:
    return
  if seq_len % sizes["sequence"]:
    raise base.ConfigError(
        f"config.mesh.sequence={sizes['sequence']} must divide config.seq_len={seq_len}.")
  if jax.process_count() > 1:
    raise base.ConfigError(
        f"config.mesh.sequence={sizes['sequence']} needs a single process: every host "
        f"feeds whole sequences, but {jax.process_count()} processes are running.")


def make_mesh(config: ml_collections.ConfigDict,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The MESH_AXES mesh over `devices` (default: all)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(config, len(devices))
  return jax.make_mesh(shape, MESH_AXES, devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def rules_from_config(config: ml_collections.ConfigDict) -> tuple[tuple[str, Any], ...]:
  """config.mesh.rules (pairs) on top of DEFAULT_RULES."""
  rules = dict(DEFAULT_RULES)
  for name, axis in config.get("rules", ()) or ():
    if axis is not None and axis not in MESH_AXES:
      raise base.ConfigError(
          f"config.mesh.rules maps {name!r} to {axis!r}; mesh axes are "
          f"{MESH_AXES} or None.")
    rules[name] = axis
  return tuple(rules.items())


def logical_to_spec(names: Sequence[str | None] | None, shape: Sequence[int],
                    mesh: Mesh, rules: Rules) -> PartitionSpec:
  """PartitionSpec for an array of `shape` with logical axis `names`.

  A mesh axis is used at most once, and only where it divides the dimension.
  """
  if not names:
    return PartitionSpec()
  if len(names) != len(shape):
    raise ValueError(
        f"sharding names {tuple(names)} do not match the array shape {tuple(shape)}.")
  mapping = dict(rules)
  used = set()
  spec = []
  for name, size in zip(names, shape):
    axis = mapping.get(name) if name is not None else None
    if (axis is None or axis in used or mesh.shape[axis] == 1
        or size % mesh.shape[axis]):
      spec.append(None)
    else:
      used.add(axis)
      spec.append(axis)
  return PartitionSpec(*spec)


def state_shardings(abstract_state: nnx.State, mesh: Mesh, rules: Rules) -> Any:
  """Pure-dict tree of NamedShardings for an (abstract) nnx.State."""

  def sharding(variable):
    names = variable.get_metadata().get("out_sharding")
    return NamedSharding(mesh, logical_to_spec(names, variable.shape, mesh, rules))

  shardings = jax.tree.map(sharding, abstract_state,
                           is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.to_pure_dict(shardings)


def batch_shards(mesh: Mesh) -> int:
  """How many pieces the batch is split into: the product of BATCH_AXES sizes."""
  return math.prod(mesh.shape[axis] for axis in BATCH_AXES)


def kernel_context(mesh: Mesh, rules: Rules, *, context_parallel: bool = False
                   ) -> Callable[[], contextlib.AbstractContextManager]:
  """() -> the context in which Pallas kernels run per device shard.

  The batch is split over BATCH_AXES and the heads over the mesh axis that
  `rules` map "heads" to (ops.kernel_sharding; XLA cannot split a Pallas call
  itself and would compute the whole batch on every device). Where `rules` map
  "length" to a mesh axis of size > 1, time is split over it too and the
  sequence mixers run context-parallel; `context_parallel` takes that path also
  where the axis has size 1 (to measure what the path itself costs).
  """
  head_axis = dict(rules).get("heads")
  time_axis = sequence_axis(mesh, rules)
  if context_parallel and time_axis is None:
    time_axis = dict(rules).get("length")
    if time_axis is None:
      raise ValueError('context_parallel needs rules that map "length" to a mesh axis')
  return functools.partial(kernel_sharding.kernel_sharding, mesh, BATCH_AXES,
                           (head_axis,) if head_axis else (), time_axis)


class MeshContext(NamedTuple):
  """Where a step runs: the mesh, the logical-axis rules on it, and the kernel context
  (`kernel_context`) its jitted functions are traced in."""

  mesh: Mesh
  rules: Rules
  kernel_context: Callable[[], contextlib.AbstractContextManager]


def mesh_context(config: ml_collections.ConfigDict,
                 devices: Sequence[jax.Device] | None = None, *,
                 context_parallel: bool = False) -> MeshContext:
  """The mesh of config's MESH_AXES sizes over `devices` (default: all), config.rules on
  DEFAULT_RULES, and the kernel context they give (`kernel_context`)."""
  mesh = make_mesh(config, devices)
  rules = rules_from_config(config)
  return MeshContext(mesh, rules,
                     kernel_context(mesh, rules, context_parallel=context_parallel))


def sequence_axis(mesh: Mesh, rules: Rules) -> str | None:
  """The mesh axis of size > 1 that `rules` map "length" to, or None."""
  axis = dict(rules).get("length")
  return axis if axis is not None and mesh.shape[axis] > 1 else None


def batch_sharding(mesh: Mesh, shape: Sequence[int] = (), rules: Rules = DEFAULT_RULES
                   ) -> NamedSharding:
  """Batch dimension split over the data and fsdp axes; dimension 1 of `shape`
  (the length) over the sequence axis where that divides it; the rest replicated."""
  axis = sequence_axis(mesh, rules)
  if len(shape) < 2 or axis is None or shape[1] % mesh.shape[axis]:
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))
  return NamedSharding(mesh, PartitionSpec(BATCH_AXES, axis))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def global_batch(local_batch: dict[str, np.ndarray], mesh: Mesh,
                 rules: Rules = DEFAULT_RULES) -> dict[str, jax.Array]:
  """Assembles this host's rows into global arrays (batch_sharding)."""
  return {name: jax.make_array_from_process_local_data(
              batch_sharding(mesh, value.shape, rules), value)
          for name, value in local_batch.items()}
