"""Input checks and time-chunking helpers shared by the recurrence ops in palimpsa_jax.ops.

Checks raise TypeError/ValueError whose message names the argument and the expected shape or
dtype. Chunk helpers work on the op layout [B, T, H, ...].
"""

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch


def check_array(name: str, x, shape: tuple[int, ...], layout: str, kind: str = "float"):
  """Raises TypeError/ValueError unless `x` is an array of `shape` and dtype `kind`.

  Args:
    name: argument name used in the error message.
    x: the value to check.
    shape: expected shape.
    layout: the expected shape in words, e.g. "[B, T, H, K]".
    kind: "float" (any floating dtype) or "int" (any integer dtype).
  """
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array of shape {layout}, got {type(x).__name__}.")
  if kind == "float" and not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must have a floating dtype, got {x.dtype}.")
  if kind == "int" and not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype, got {x.dtype}.")
  if tuple(x.shape) != tuple(shape):
    raise ValueError(f"{name} must have shape {layout} = {tuple(shape)}, got {tuple(x.shape)}.")


def check_options(implementation: str, chunk_size: int, table: Mapping[str, Any]):
  """Raises ValueError/TypeError for an implementation that is neither "auto" nor a name of
  the op's `table`, or a bad chunk size."""
  dispatch.check_name(implementation, table)
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
    raise TypeError(f"chunk_size must be a positive int, got {chunk_size!r}.")
  if chunk_size < 1:
    raise ValueError(f"chunk_size must be a positive int, got {chunk_size}.")


def check_sequences(q, k, v, initial_state, segment_ids) -> tuple[int, int, int, int, int]:
  """Checks q, k [B, T, H, K], v [B, T, H, V], initial_state, segment_ids; returns B, T, H, K, V.

  initial_state ([B, H, V, K] float) and segment_ids ([B, T] int) may be None.
  """
  for name, x, layout in (("q", q, "[B, T, H, K]"), ("v", v, "[B, T, H, V]")):
    if not hasattr(x, "shape") or getattr(x, "ndim", None) != 4:
      raise ValueError(f"{name} must be an array of shape {layout}, got {getattr(x, 'shape', x)}.")
  batch, time, heads, key_dim = q.shape
  value_dim = v.shape[-1]
  check_array("q", q, q.shape, "[B, T, H, K]")
  check_array("k", k, q.shape, "[B, T, H, K] (same as q)")
  check_array("v", v, (batch, time, heads, value_dim), "[B, T, H, V]")
  if time < 1:
    raise ValueError(f"q must have at least one time step (T >= 1), got shape {q.shape}.")
  if initial_state is not None:
    state_shape = (batch, heads, value_dim, key_dim)
    check_array("initial_state", initial_state, state_shape, "[B, H, V, K]")
  if segment_ids is not None:
    check_array("segment_ids", segment_ids, (batch, time), "[B, T]", kind="int")
  return batch, time, heads, key_dim, value_dim


def segment_starts(segment_ids: jax.Array | None, batch: int, time: int) -> jax.Array:
  """[B, T] bool: True where a new segment starts (id differs from the previous step).

  Step 0 is never a start: the initial state always applies to it.
  """
  if segment_ids is None:
    return jnp.zeros((batch, time), bool)
  changed = segment_ids[:, 1:] != segment_ids[:, :-1]
  return jnp.pad(changed, ((0, 0), (1, 0)))


def chunk_masks(log_alpha_chunks: jax.Array, start_chunks: jax.Array):
  """Decay factors of one chunk, with segment resets folded in.

  Args:
    log_alpha_chunks: [B, N, H, C] log-decays, N chunks of C steps.
    start_chunks: [B, N, C] bool segment starts.

  Returns:
    decay:      [B, N, H, C, C], exp(G_i - G_j) for j <= i in one segment, else 0.
    from_start: [B, N, H, C], exp(G_i) if no segment starts in the chunk up to i, else 0
                (how much of the chunk's initial state reaches step i).
    to_end:     [B, N, H, C], exp(G_C - G_j) if j is in the chunk's last segment, else 0
                (how much of step j's write reaches the chunk's final state).
  with G_i the cumulative log-decay from the chunk start up to step i inclusive.
  """
  cum = jnp.cumsum(log_alpha_chunks, axis=-1)
  seg = jnp.cumsum(start_chunks.astype(jnp.int32), axis=-1)[:, :, None, :]  # [B, N, 1, C]
  size = log_alpha_chunks.shape[-1]
  causal = jnp.tril(jnp.ones((size, size), bool))
  mask = causal & (seg[..., :, None] == seg[..., None, :])
  diff = cum[..., :, None] - cum[..., None, :]
  decay = jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)
  from_start = jnp.where(seg == 0, jnp.exp(cum), 0.0)
  last = seg == seg[..., -1:]
  to_end = jnp.where(last, jnp.exp(jnp.where(last, cum[..., -1:] - cum, 0.0)), 0.0)
  return decay, from_start, to_end


def to_chunks(x: jax.Array, size: int) -> jax.Array:
  """[B, T, H, ...] (T a multiple of size) -> [B, N, H, C, ...]."""
  b, t = x.shape[:2]
  x = x.reshape(b, t // size, size, *x.shape[2:])
  return jnp.moveaxis(x, 2, 3)


def pad_time(x: jax.Array, size: int) -> jax.Array:
  """Zero-pads axis 1 up to a multiple of size."""
  extra = -x.shape[1] % size
  return jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))
