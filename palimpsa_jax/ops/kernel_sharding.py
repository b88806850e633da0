"""Runs a Pallas kernel on each device's shard of the batch and heads.

XLA's SPMD partitioner cannot split a Pallas custom call: under a sharded jit it
gathers the kernel's operands and every device computes the whole batch (on two
H200s the data-parallel Palimpsa-D step grew by about the op's full time). Code
that traces a sharded step enters `kernel_sharding(mesh, batch_axes,
head_axes)`; inside it, `shard_kernel` wraps the kernel in a shard_map over the
batch and head dimensions, along which the recurrences are independent.

Layouts name each operand's dimensions: "b" batch, "h" heads, "." any other
(kept whole on every device), e.g. "b.h." for [B, T, H, K].
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
  """The mesh of the step being traced and the axes of its batch and heads."""

  mesh: Mesh
  batch_axes: tuple[str, ...]
  head_axes: tuple[str, ...]


class _Context(threading.local):
  sharding: KernelSharding | None = None


_context = _Context()


@contextlib.contextmanager
def kernel_sharding(mesh: Mesh, batch_axes: Sequence[str],
                    head_axes: Sequence[str] = ()):
  """Within: kernels traced by shard_kernel run per shard of `mesh`.

  Args:
    mesh: the mesh the traced step's arrays live on.
    batch_axes: mesh axes that shard the batch dimension, outermost first.
    head_axes: mesh axes that may shard the head dimension.
  """
  for axis in (*batch_axes, *head_axes):
    if axis not in mesh.axis_names:
      raise ValueError(f"kernel_sharding: axis {axis!r} is not in the mesh's "
                       f"axes {mesh.axis_names}")
  previous = _context.sharding
  _context.sharding = KernelSharding(mesh, tuple(batch_axes), tuple(head_axes))
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


def _spec(layout: str, batch: tuple[str, ...], heads: tuple[str, ...]) -> PartitionSpec:
  names = {"b": batch or None, "h": heads or None, ".": None}
  return PartitionSpec(*(names[c] for c in layout))


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
  batch = _dividing_axes(mesh, sharding.batch_axes, batch_size)
  heads = _dividing_axes(mesh, [a for a in sharding.head_axes if a not in batch],
                         num_heads)
  if not batch and not heads:
    if any(mesh.shape[a] > 1 for a in (*sharding.batch_axes, *sharding.head_axes)):
      warnings.warn(
          f"shard_kernel: batch {batch_size} and {num_heads} heads do not divide over the "
          f"mesh axes {sharding.batch_axes} / {sharding.head_axes} of {dict(mesh.shape)}; "
          "every device runs the kernel on the whole arrays.", stacklevel=2)
    return kernel(*args)
  present = [i for i, a in enumerate(args) if a is not None]

  def local(*arrays):
    full = list(args)
    for i, array in zip(present, arrays):
      full[i] = array
    outs = kernel(*full)
    return tuple(o for o in outs if o is not None)

  in_specs = tuple(_spec(in_layouts[i], batch, heads) for i in present)
  out_specs = tuple(_spec(layout, batch, heads) for layout in out_layouts
                    if layout is not None)
  results = iter(jax.shard_map(local, mesh=mesh, in_specs=in_specs,
                               out_specs=out_specs, check_vma=False)(
                                   *(args[i] for i in present)))
  return tuple(None if layout is None else next(results) for layout in out_layouts)
