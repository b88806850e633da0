"""Block geometry of the TPU kernels and the moves between the op layout and theirs.

The kernels keep each state tile as [K, 128]: the key dimension on sublanes (padded to a multiple
of 16, legal for float32 and bfloat16 tiles) and a 128-lane tile of the value dimension on lanes.
Time runs on lanes for q, k ([N, Kp, Tp], N = B*H) and the per-step gates ([N, 1, Tp]), so that a
chunk's q^T and k^T arrive as ready-made [Kp, C] blocks, and on sublanes for v, beta and the
outputs ([N, Tp, Vp], float32) so that every step reads and writes one row.
"""

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.common import round_up

LANES = 128
MAX_KEY_DIM = 256
# VMEM budget (bytes) for the backward kernel's recomputed states and checkpoints.
_BACKWARD_STATE_BUDGET = 8 * 2**20


@dataclasses.dataclass(frozen=True)
class Geometry:
  """Padded sizes and blocks for one call.

  n: B*H; t, kd, vd: true sizes; tp, kp, vp: padded sizes; chunk: time block C (a multiple of
  128, or the whole padded sequence when it is shorter); sub: backward recompute block (divides
  chunk).
  """

  batch: int
  heads: int
  t: int
  kd: int
  vd: int
  chunk: int
  kp: int
  vp: int
  tp: int
  sub: int

  @property
  def n(self) -> int:
    return self.batch * self.heads

  @property
  def num_chunks(self) -> int:
    return self.tp // self.chunk

  @property
  def num_vtiles(self) -> int:
    return self.vp // LANES


def geometry(q_shape: tuple[int, ...], vd: int, chunk_size: int, *,
             short_chunks: bool = False) -> Geometry:
  """Blocks for q [B,T,H,K] and value dim vd; raises NotImplementedError where unsupported.

  The time block is chunk_size rounded up to 128 lanes. short_chunks (used by the interpreter)
  shrinks it to the sequence rounded up to 16 when that is shorter; compiled kernels keep every
  lane dimension a multiple of 128, so Mosaic never sees a partial-lane matmul contraction.
  """
  batch, t, heads, kd = q_shape
  if kd > MAX_KEY_DIM:
    raise NotImplementedError(f"palimpsa_tpu supports key dims up to {MAX_KEY_DIM}, got {kd}.")
  kp = round_up(kd, 16)
  vp = round_up(vd, LANES)
  chunk = round_up(chunk_size, LANES)
  if short_chunks and t <= chunk:
    chunk = round_up(t, 16)
  tp = round_up(t, chunk)
  return Geometry(batch, heads, t, kd, vd, chunk, kp, vp, tp, _sub_block(chunk, kp))


def _sub_block(chunk: int, kp: int) -> int:
  """Largest divisor S of chunk (multiple of 8) whose recompute buffers fit the VMEM budget."""
  tile = kp * LANES * 4
  for sub in range(chunk, 7, -8):
    if chunk % sub:
      continue
    if 2 * (sub + 1 + chunk // sub) * tile <= _BACKWARD_STATE_BUDGET:
      return sub
  return 8


def keys_to_kernel(x: jax.Array, g: Geometry) -> jax.Array:
  """[B,T,H,K] -> [N, Kp, Tp] (time on lanes), zero padded, dtype kept."""
  x = jnp.transpose(x, (0, 2, 3, 1)).reshape(g.n, g.kd, g.t)
  return jnp.pad(x, ((0, 0), (0, g.kp - g.kd), (0, g.tp - g.t)))


def keys_from_kernel(x: jax.Array, g: Geometry) -> jax.Array:
  """[N, Kp, Tp] -> [B,T,H,K]."""
  x = x[:, :g.kd, :g.t].reshape(g.batch, g.heads, g.kd, g.t)
  return jnp.transpose(x, (0, 3, 1, 2))


def values_to_kernel(x: jax.Array, g: Geometry) -> jax.Array:
  """[B,T,H,V] -> [N, Tp, Vp] float32 (time on sublanes: one-row loads need unpacked rows)."""
  x = jnp.transpose(x.astype(jnp.float32), (0, 2, 1, 3)).reshape(g.n, g.t, g.vd)
  return jnp.pad(x, ((0, 0), (0, g.tp - g.t), (0, g.vp - g.vd)))


def values_from_kernel(x: jax.Array, g: Geometry) -> jax.Array:
  """[N, Tp, Vp] -> [B,T,H,V]."""
  x = x[:, :g.t, :g.vd].reshape(g.batch, g.heads, g.t, g.vd)
  return jnp.transpose(x, (0, 2, 1, 3))


def steps_to_kernel(x: jax.Array, g: Geometry, fill: float) -> jax.Array:
  """Per-step scalars [B,T,H] -> [N, 1, Tp] float32 (time on lanes), padded with `fill`."""
  x = jnp.transpose(x, (0, 2, 1)).reshape(g.n, 1, g.t).astype(jnp.float32)
  return jnp.pad(x, ((0, 0), (0, 0), (0, g.tp - g.t)), constant_values=fill)


def steps_from_kernel(x: jax.Array, g: Geometry) -> jax.Array:
  """[N, 1, Tp] -> [B,T,H]."""
  return jnp.transpose(x[:, 0, :g.t].reshape(g.batch, g.heads, g.t), (0, 2, 1))


def state_to_kernel(x: jax.Array, g: Geometry) -> jax.Array:
  """State [B,H,V,K] -> [N, Kp, Vp] float32, zero padded."""
  x = jnp.swapaxes(x.astype(jnp.float32), -1, -2).reshape(g.n, g.kd, g.vd)
  return jnp.pad(x, ((0, 0), (0, g.kp - g.kd), (0, g.vp - g.vd)))


def state_from_kernel(x: jax.Array, g: Geometry) -> jax.Array:
  """[N, Kp, Vp] -> [B,H,V,K]."""
  x = x[:, :g.kd, :g.vd].reshape(g.batch, g.heads, g.kd, g.vd)
  return jnp.swapaxes(x, -1, -2)


def prior_to_kernel(prior_precision: jax.Array, g: Geometry) -> jax.Array:
  """Ip [H] -> [N, 1, Vp] float32 rows (the prior broadcast along the value lanes)."""
  ip = jnp.broadcast_to(prior_precision.astype(jnp.float32)[None, :, None],
                        (g.batch, g.heads, g.vp))
  return ip.reshape(g.n, 1, g.vp)
