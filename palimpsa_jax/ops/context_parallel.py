"""Context parallelism: one sequence split over a mesh axis, exact for the Palimpsa family.

In the linear form (M = mu * I, Ibar = I - Ip) the state follows

    M_t = a_t M_{t-1} + v_t k_t^T,   Ibar_t = a_t Ibar_{t-1} + beta_t (k_t^2)^T

with one scalar gate a_t per step, so what a shard of L steps does to the state it
receives is affine: S_end = P * S_start + D, with P = prod_t a_t and D the state the shard
reaches from zero. Under ops.kernel_sharding with a sequence axis of size S, every device:

1. computes its shard's transition (P [B, H], D = (M, Ibar) [B, H, V, K]) with two matmuls
   over its steps (no readout, no division);
2. all-gathers the S transitions (one collective) and composes them in order, which gives
   every shard's true start state and the final state on every device;
3. runs the op once on its shard from that start state.

The readout divides by I_t, which depends on the start state, so a shard's outputs are not
a linear correction of zero-start outputs: step 3 reruns the walk instead, and step 1 is the
only added work (about the cost of the chunked form's boundary-state pass). The backward is
JAX autodiff of these steps: the op's own VJP gives the cotangent of each start state, and
the transpose of the all-gather (a reduce-scatter) carries it back to the earlier shards'
transitions.

Segment ids stay exact across borders: a shard whose first id differs from the previous
shard's last id starts from the prior (its P is zeroed before the exchange).
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from palimpsa_jax.ops import kernel_sharding
from palimpsa_jax.ops.common import segment_starts

_HIGHEST = jax.lax.Precision.HIGHEST

# (q, k, v, beta, log_alpha, prior_precision, segment_ids, m_start, ibar_start) on one
# shard -> (out, variance or None); ibar_start is None when beta is None.
LocalOp = Callable[..., tuple[jax.Array, jax.Array | None]]


def active() -> kernel_sharding.KernelSharding | None:
  """The kernel_sharding in effect if it has a sequence axis, else None."""
  sharding = kernel_sharding.current()
  if sharding is None or sharding.sequence_axis is None:
    return None
  return sharding


def _shards(sharding: kernel_sharding.KernelSharding, length: int, name: str) -> int:
  """Size of the sequence axis; raises ValueError unless it divides `length`."""
  count = sharding.mesh.shape[sharding.sequence_axis]
  if length % count:
    raise ValueError(
        f"{name} has {length} time steps, which the sequence axis "
        f"{sharding.sequence_axis!r} of size {count} does not divide; use a sequence "
        f"length that is a multiple of {count}.")
  return count


def _previous_shard(x: jax.Array, axis: str, count: int) -> jax.Array:
  """On shard i, shard i-1's x (zeros on shard 0): one ppermute."""
  if count == 1:
    return jnp.zeros_like(x)
  return jax.lax.ppermute(x, axis, [(i, i + 1) for i in range(count - 1)])


def _after(x: jax.Array) -> jax.Array:
  """sum_{s > t} x_s along axis 1."""
  suffix = jax.lax.cumsum(x, axis=1, reverse=True)
  return jnp.concatenate([suffix[:, 1:], jnp.zeros_like(suffix[:, :1])], axis=1)


def shard_transition(k, v, beta, log_alpha, starts):
  """What one shard does to the state: S_end = decay * S_start + (m, ibar).

  Args:
    k: [B, L, H, K] f32; v, beta: [B, L, H, V] f32 (beta may be None: ibar is None).
    log_alpha: [B, L, H] f32.
    starts: [B, L] bool, the steps where the state restarts from the prior.

  Returns:
    decay [B, H] = prod_t a_t (0 if a segment starts in the shard); m, ibar [B, H, V, K],
    the end state from a zero start.
  """
  # Sums of log-decays and counts of restarts (not products of gates, whose gradient
  # XLA:CPU fails to compile inside a shard_map).
  later = _after(log_alpha)  # [B, L, H]
  cut = (_after(starts.astype(jnp.int32)) > 0)[..., None]  # a restart after t
  w = jnp.where(cut, 0.0, jnp.exp(later))[..., None]  # share of step t's write at the end
  m = jnp.einsum("bthv,bthk->bhvk", v * w, k, precision=_HIGHEST)
  ibar = (None if beta is None else
          jnp.einsum("bthv,bthk->bhvk", beta * w, k * k, precision=_HIGHEST))
  decay = jnp.where(jnp.any(starts, axis=1)[:, None], 0.0,
                    jnp.exp(jnp.sum(log_alpha, axis=1)))
  return decay, m, ibar


def _compose(decays, ms, ibars, m0, ibar0):
  """Start state of every shard and the final state from the gathered transitions.

  decays [S, B, H]; ms, ibars [S, B, H, V, K] (ibars and ibar0 may be None);
  m0, ibar0 [B, H, V, K], the state before shard 0.
  Returns (starts, final), each a tuple (m, ibar) with starts stacked [S, ...].
  """
  def step(state, transition):
    decay, m, ibar = transition
    d = decay[..., None, None]
    new = (d * state[0] + m, None if ibar is None else d * state[1] + ibar)
    return new, state

  return jax.lax.scan(step, (m0, ibar0), (decays, ms, ibars))[::-1]


def palimpsa_over_sequence(local_op: LocalOp, q, k, v, beta, log_alpha, prior_precision,
                           m0, ibar0, segment_ids, return_variance):
  """The op with time split over the sequence axis of the kernel_sharding in effect.

  Args:
    local_op: runs the op on one shard from a given start state (see LocalOp).
    q, k [B, T, H, K]; v [B, T, H, V]; beta [B, T, H, V] or None; log_alpha [B, T, H];
    prior_precision [H] f32; m0, ibar0 [B, H, V, K] f32, the linear-form state before
    step 0 (ibar0 None when beta is None); segment_ids [B, T] int or None.
    return_variance: whether local_op returns the variance.

  Returns:
    out [B, T, H, V], variance or None, final (m, ibar) [B, H, V, K] f32 (ibar None when
    beta is None).
  """
  sharding = active()
  batch_size, length, num_heads, _ = q.shape
  count = _shards(sharding, length, "q")
  axis = sharding.sequence_axis
  batch_axes, head_axes = kernel_sharding.batch_and_head_axes(sharding, batch_size,
                                                              num_heads)
  has_beta = beta is not None

  def per_shard(q, k, v, beta, log_alpha, ip, m0, ibar0, seg):
    f32 = lambda x: None if x is None else x.astype(jnp.float32)
    starts = segment_starts(seg, *q.shape[:2])  # [B, L]; step 0 never
    border = None
    if seg is not None:  # does this shard's first step start a new segment?
      last = _previous_shard(seg[:, -1], axis, count)
      border = (jax.lax.axis_index(axis) > 0) & (seg[:, 0] != last)  # [B]
      starts = starts.at[:, 0].set(border)
    decay, m, ibar = shard_transition(f32(k), f32(v), f32(beta), f32(log_alpha), starts)
    gathered = jax.lax.all_gather((decay, m, ibar), axis)
    (m_starts, ibar_starts), (m_end, ibar_end) = _compose(*gathered, m0, ibar0)
    index = jax.lax.axis_index(axis)
    m_in = m_starts[index]
    ibar_in = None if ibar_starts is None else ibar_starts[index]
    if border is not None:
      keep = jnp.where(border, 0.0, 1.0)[:, None, None, None]
      m_in = m_in * keep
      ibar_in = None if ibar_in is None else ibar_in * keep
    out, var = local_op(q, k, v, beta, log_alpha, ip, seg, m_in, ibar_in)
    return out, var, m_end, ibar_end

  out, var, m_end, ibar_end = kernel_sharding.shard_map_layouts(
      per_shard, (q, k, v, beta, log_alpha, prior_precision, m0, ibar0, segment_ids),
      in_layouts=("bth.", "bth.", "bth.", "bth.", "bth", "h", "bh..", "bh..", "bt"),
      out_layouts=("bth.", "bth." if return_variance else None, "bh..",
                   "bh.." if has_beta else None),
      mesh=sharding.mesh, batch=batch_axes, heads=head_axes, sequence=axis)
  return out, var, m_end, ibar_end


def with_halo(fn: Callable[..., jax.Array], x, state, segment_ids, weights, halo_size: int):
  """fn on each time shard with the `halo_size` inputs before it (a short convolution).

  Args:
    fn: (x [B, L, C], halo [B, W-1, C] f32, halo_ids [B, W-1] or None, ids [B, L] or None,
      *weights) -> y [B, L, C]; the halo holds the inputs just before the shard.
    x: [B, T, C]; state: [B, W-1, C] f32, the inputs before the sequence; segment_ids [B, T]
      or None; weights: arrays [..., C] or None, the same on every time shard.
    halo_size: W - 1 (>= 1); each shard must hold at least that many steps.

  Returns:
    y [B, T, C]. Shard 0's halo is `state` (and its ids the first id); shard i's the last
    W - 1 inputs and ids of shard i-1 (one ppermute each).
  """
  sharding = active()
  batch_size, length, channels = x.shape
  count = _shards(sharding, length, "x")
  if length // count < halo_size:
    raise ValueError(
        f"each of the {count} sequence shards holds {length // count} steps, fewer than "
        f"the convolution's {halo_size} steps of context; use longer sequences.")
  axis = sharding.sequence_axis
  batch_axes, channel_axes = kernel_sharding.batch_and_head_axes(sharding, batch_size,
                                                                 channels)

  def per_shard(x, state, seg, *weights):
    first = jax.lax.axis_index(axis) == 0
    halo = _previous_shard(x[:, -halo_size:].astype(jnp.float32), axis, count)
    halo = jnp.where(first, state, halo)
    halo_ids = None
    if seg is not None:
      halo_ids = _previous_shard(seg[:, -halo_size:], axis, count)
      halo_ids = jnp.where(first, jnp.repeat(seg[:, :1], halo_size, axis=1), halo_ids)
    return (fn(x, halo, halo_ids, seg, *weights),)

  weight_layouts = tuple("." * (w.ndim - 1) + "h" if w is not None else "" for w in weights)
  (y,) = kernel_sharding.shard_map_layouts(
      per_shard, (x, state, segment_ids, *weights),
      in_layouts=("bth", "b.h", "bt") + weight_layouts, out_layouts=("bth",),
      mesh=sharding.mesh, batch=batch_axes, heads=channel_axes, sequence=axis)
  return y
