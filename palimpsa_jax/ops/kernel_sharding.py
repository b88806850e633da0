"""Runs a Pallas kernel on each device's shard of the batch and heads.

XLA's SPMD partitioner cannot split a Pallas custom call: under a sharded jit it
gathers the kernel's operands and every device computes the whole batch (on two
H200s the data-parallel Palimpsa-D step grew by about the op's full time). Code
that traces a sharded step enters `kernel_sharding(mesh, batch_axes,
head_axes)`; inside it, `shard_kernel` wraps the kernel in a shard_map over the
batch and head dimensions, along which the recurrences are independent.

Layouts name each operand's dimensions: "b" batch, "h" heads, "t" time (split
over the context's sequence axis, ops.context_parallel), "." any other (kept
whole on every device), e.g. "b.h." for [B, T, H, K].
"""

from collections.abc import Callable, Sequence
import contextlib
import dataclasses
import math
import threading
from typing import Any
import warnings

import jax
from jax.sharding import Mesh, PartitionSpec


@dataclasses.dataclass(frozen=True)
class KernelSharding:
  """The mesh of the step being traced and the axes of its batch, heads and time.

  sequence_axis: the mesh axis one sequence is split over (context
  parallelism, ops.context_parallel), or None.
  """

  mesh: Mesh
  batch_axes: tuple[str, ...]
  head_axes: tuple[str, ...]
  sequence_axis: str | None = None


class _Context(threading.local):
  sharding: KernelSharding | None = None


_context = _Context()


@contextlib.contextmanager
def kernel_sharding(mesh: Mesh, batch_axes: Sequence[str],
                    head_axes: Sequence[str] = (), sequence_axis: str | None = None):
  """Within: kernels traced by shard_kernel run per shard of `mesh`.

  Args:
    mesh: the mesh the traced step's arrays live on.
    batch_axes: mesh axes that shard the batch dimension, outermost first.
    head_axes: mesh axes that may shard the head dimension.
    sequence_axis: a mesh axis that splits the time dimension: the sequence
      mixers then run context-parallel (ops.context_parallel), also when the
      axis has size 1. None: time stays whole.
  """
  named = (*batch_axes, *head_axes) + (() if sequence_axis is None else (sequence_axis,))
  for axis in named:
    if axis not in mesh.axis_names:
      raise ValueError(f"kernel_sharding: axis {axis!r} is not in the mesh's "
                       f"axes {mesh.axis_names}")
  if sequence_axis is not None and sequence_axis in (*batch_axes, *head_axes):
    raise ValueError(f"kernel_sharding: sequence_axis {sequence_axis!r} is also a "
                     "batch or head axis")
  previous = _context.sharding
  _context.sharding = KernelSharding(mesh, tuple(batch_axes), tuple(head_axes),
                                     sequence_axis)
  try:
    yield
  finally:
    _context.sharding = previous


@contextlib.contextmanager
def suspended():
  """Within: no kernel_sharding is in effect (for code traced inside a shard_map body,
  whose arrays are already per-device shards)."""
  previous = _context.sharding
  _context.sharding = None
  try:
    yield
  finally:
    _context.sharding = previous


def current() -> KernelSharding | None:
  """The innermost kernel_sharding in effect, or None."""
  return _context.sharding


def _dividing_axes(mesh: Mesh, axes: Sequence[str], size: int) -> tuple[str, ...]:
  """The longest prefix of `axes` (size-1 axes dropped) whose product divides size."""
  chosen = []
  for axis in axes:
    if mesh.shape[axis] == 1:
      continue
    if size % (math.prod(mesh.shape[a] for a in chosen) * mesh.shape[axis]):
      break
    chosen.append(axis)
  return tuple(chosen)


def _spec(layout: str, batch: tuple[str, ...], heads: tuple[str, ...],
          sequence: str | None = None) -> PartitionSpec:
  names = {"b": batch or None, "h": heads or None, "t": sequence, ".": None}
  return PartitionSpec(*(names[c] for c in layout))


def batch_and_head_axes(sharding: KernelSharding, batch_size: int, num_heads: int
                        ) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """The batch axes and the head axes (not among them) that divide B and H."""
  batch = _dividing_axes(sharding.mesh, sharding.batch_axes, batch_size)
  heads = _dividing_axes(sharding.mesh, [a for a in sharding.head_axes if a not in batch],
                         num_heads)
  return batch, heads


def shard_map_layouts(fn: Callable[..., Any], args: Sequence[jax.Array | None],
                      in_layouts: Sequence[str], out_layouts: Sequence[str | None],
                      mesh: Mesh, batch: tuple[str, ...], heads: tuple[str, ...],
                      sequence: str | None = None) -> Any:
  """fn(*args) under a shard_map whose specs follow the layout strings.

  None args are passed to fn as None; out_layouts has None where fn returns None.
  fn runs with no kernel_sharding in effect (its arrays are per-device shards).
  """
  present = [i for i, a in enumerate(args) if a is not None]

  def local(*arrays):
    full = list(args)
    for i, array in zip(present, arrays):
      full[i] = array
    with suspended():
      outs = fn(*full)
    return tuple(o for o in outs if o is not None)

  in_specs = tuple(_spec(in_layouts[i], batch, heads, sequence) for i in present)
  out_specs = tuple(_spec(layout, batch, heads, sequence) for layout in out_layouts
                    if layout is not None)
  results = iter(jax.shard_map(local, mesh=mesh, in_specs=in_specs,
                               out_specs=out_specs, check_vma=False)(
                                   *(args[i] for i in present)))
  return tuple(None if layout is None else next(results) for layout in out_layouts)


def shard_kernel(kernel: Callable[..., Any], args: Sequence[jax.Array | None],
                 in_layouts: Sequence[str], out_layouts: Sequence[str | None],
                 batch_size: int, num_heads: int) -> Any:
  """kernel(*args), per device shard when inside kernel_sharding.

  Args:
    kernel: (*args) -> tuple of outputs (None entries allowed); called with
      per-shard arrays (None args passed through).
    args: the operands; None entries are passed as None.
    in_layouts: one layout string per arg (ignored for None args).
    out_layouts: one layout per output; None for an output that is None.
    batch_size, num_heads: the global B and H.

  Returns:
    The kernel's outputs, as global arrays.
  """
  sharding = current()
  if sharding is None:
    return kernel(*args)
  mesh = sharding.mesh
  batch, heads = batch_and_head_axes(sharding, batch_size, num_heads)
  if not batch and not heads:
    if any(mesh.shape[a] > 1 for a in (*sharding.batch_axes, *sharding.head_axes)):
      warnings.warn(
          f"shard_kernel: batch {batch_size} and {num_heads} heads do not divide over the "
          f"mesh axes {sharding.batch_axes} / {sharding.head_axes} of {dict(mesh.shape)}; "
          "every device runs the kernel on the whole arrays.", stacklevel=2)
    return kernel(*args)
  return shard_map_layouts(kernel, args, in_layouts, out_layouts, mesh, batch, heads)
