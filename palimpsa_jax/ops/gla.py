"""Scalar-gated linear attention (SimpleGLA; the Mamba2 / SSD recurrence).

Per batch element and head, with a_t = exp(log_alpha_t):

    h_t   = a_t * h_{t-1} + v_t k_t^T          (h: [V, K])
    out_t = h_t q_t

This is Palimpsa with beta = 0 and prior precision 1 (SPEC.md sec. 3); `palimpsa(beta=None)`
divides by the prior precision itself. Shapes: q, k [B, T, H, K]; v [B, T, H, V];
log_alpha [B, T, H]; state [B, H, V, K] float32. All arithmetic runs in float32.

The input checks and chunk helpers below are shared with the gated delta rule op.
"""

from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

IMPLEMENTATIONS = ("auto", "sequential", "chunked")
_HIGHEST = lax.Precision.HIGHEST


class GLAResult(NamedTuple):
  """What `simple_gla` returns.

  out:   [B, T, H, V], dtype of v: readout h_t q_t.
  state: [B, H, V, K] float32, h after the last step.
  """

  out: jax.Array
  state: jax.Array


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


def check_options(implementation: str, chunk_size: int, allowed: tuple[str, ...]):
  """Raises ValueError/TypeError for an unknown implementation or a bad chunk size."""
  if implementation not in allowed:
    raise ValueError(f"implementation must be one of {allowed}, got {implementation!r}.")
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


def _sequential(q, k, v, log_alpha, h0, starts):
  """Step-by-step lax.scan over time; inputs float32, time-major inside."""

  def step(h, xs):
    q_t, k_t, v_t, log_a_t, start_t = xs
    a_t = jnp.where(start_t[:, None], 0.0, jnp.exp(log_a_t))  # [B, H]
    h = a_t[..., None, None] * h + v_t[..., :, None] * k_t[..., None, :]
    return h, jnp.einsum("bhvk,bhk->bhv", h, q_t, precision=_HIGHEST)

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, log_alpha, starts))
  state, out = lax.scan(step, h0, xs)
  return jnp.moveaxis(out, 0, 1), state


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


def _chunked(q, k, v, log_alpha, h0, starts, chunk_size):
  """Chunkwise form: decay-masked attention inside chunks, a scan over chunk states.

  Padding steps have k = v = 0 and log_alpha = 0, so they leave the state unchanged.
  """
  batch, time, heads, _ = q.shape
  size = min(chunk_size, time)
  qc, kc, vc = (to_chunks(pad_time(x, size), size) for x in (q, k, v))  # [B, N, H, C, .]
  log_a = to_chunks(pad_time(log_alpha, size), size)  # [B, N, H, C]
  start = pad_time(starts, size).reshape(batch, -1, size)  # [B, N, C]
  decay, from_start, to_end = chunk_masks(log_a, start)

  scores = jnp.einsum("bnhik,bnhjk->bnhij", qc, kc, precision=_HIGHEST) * decay
  out_intra = jnp.einsum("bnhij,bnhjv->bnhiv", scores, vc, precision=_HIGHEST)
  increments = jnp.einsum(
      "bnhjv,bnhjk->bnhvk", vc * to_end[..., None], kc, precision=_HIGHEST)

  def step(h, xs):
    chunk_decay, increment = xs
    return chunk_decay[..., None, None] * h + increment, h

  state, h_starts = lax.scan(
      step, h0, (jnp.moveaxis(from_start[..., -1], 1, 0), jnp.moveaxis(increments, 1, 0)))
  h_starts = jnp.moveaxis(h_starts, 0, 1)  # [B, N, H, V, K]
  out_inter = jnp.einsum("bnhvk,bnhik->bnhiv", h_starts, qc, precision=_HIGHEST)
  out = out_intra + from_start[..., None] * out_inter  # [B, N, H, C, V]
  out = jnp.moveaxis(out, 3, 2).reshape(batch, -1, heads, out.shape[-1])
  return out[:, :time], state


def simple_gla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    log_alpha: jax.Array,
    *,
    initial_state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    implementation: str = "auto",
    chunk_size: int = 64,
) -> GLAResult:
  """Scalar-gated linear attention h_t = a_t h_{t-1} + v_t k_t^T, out_t = h_t q_t.

  Args:
    q: [B, T, H, K] queries (no scale is applied).
    k: [B, T, H, K] keys.
    v: [B, T, H, V] values.
    log_alpha: [B, T, H] log forget gate, expected <= 0 (not checked: values may be traced).
    initial_state: [B, H, V, K] state before step 0; zeros if None.
    segment_ids: [B, T] integer ids of packed documents; where the id changes between t-1 and t
      the state restarts from zero before step t.
    implementation: "sequential" (scan over time), "chunked" (chunkwise matmul form) or "auto"
      (chunked).
    chunk_size: steps per chunk for "chunked"; any T works (the tail is padded).

  Returns:
    GLAResult(out [B, T, H, V] in v's dtype, state [B, H, V, K] float32).
  """
  batch, time, heads, key_dim, value_dim = check_sequences(q, k, v, initial_state, segment_ids)
  check_array("log_alpha", log_alpha, (batch, time, heads), "[B, T, H]")
  state_shape = (batch, heads, value_dim, key_dim)
  check_options(implementation, chunk_size, IMPLEMENTATIONS)

  f32 = jnp.float32
  q, k, v_f, log_alpha = (x.astype(f32) for x in (q, k, v, log_alpha))
  h0 = jnp.zeros(state_shape, f32) if initial_state is None else initial_state.astype(f32)
  starts = segment_starts(segment_ids, batch, time)
  if implementation == "sequential":
    out, state = _sequential(q, k, v_f, log_alpha, h0, starts)
  else:
    out, state = _chunked(q, k, v_f, log_alpha, h0, starts, chunk_size)
  return GLAResult(out.astype(v.dtype), state)
