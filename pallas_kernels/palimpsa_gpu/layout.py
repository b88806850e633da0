"""Padded layouts and chunk gates shared by the forward and backward.

Inputs arrive as [B, T, H, D]. The kernels index one batch*head n with Tp a multiple of
the chunk size and K, V padded to multiples of 16, and read the caller's layout padded
([B, Tp, H, Dp], `pad_rows`, `rows_spec`); the backward's carry products and the gradients
they complete are head-major ([B*H, Tp, Dp], `to_head_major`, `from_head_major`).
Padding is exact: padded steps have gate 1 and zero writes, padded K/V entries stay at
the prior and are read out with zero queries.
"""

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import step_gates


class Gates(NamedTuple):
  """Per-step and per-chunk decays, all float32, with segment restarts folded in.

  step:  [BH, Tp] effective gate a'_t = alpha_t, or 0 where a segment restarts at t.
  to_end: [BH, Tp] decay from step t to its chunk's last step, prod_{u=t+1}^{end} a'_u.
  chunk: [BH, NC] decay across a whole chunk, prod_{u in chunk} a'_u.
  reset: [BH, Tp] bool, True where a segment restarts at t.
  """

  step: jax.Array
  to_end: jax.Array
  chunk: jax.Array
  reset: jax.Array


def to_head_major(x: jax.Array, t_pad: int, d_pad: int, dtype=None) -> jax.Array:
  """[B, T, H, D] -> [B*H, T + t_pad, D + d_pad] (zero padding)."""
  b, t, h, d = x.shape
  x = jnp.transpose(x, (0, 2, 1, 3)).reshape(b * h, t, d)
  if dtype is not None:
    x = x.astype(dtype)
  return jnp.pad(x, ((0, 0), (0, t_pad), (0, d_pad)))


def pad_rows(x: jax.Array, t_pad: int, d_pad: int) -> jax.Array:
  """[B, T, H, D] -> [B, T + t_pad, H, D + d_pad] (zero padding; no copy without any)."""
  if not (t_pad or d_pad):
    return x
  return jnp.pad(x, ((0, 0), (0, t_pad), (0, 0), (0, d_pad)))


def rows_spec(heads: int, t_block: int, d_block: int,
              index: Callable[..., tuple]) -> pl.BlockSpec:
  """BlockSpec of a [t_block, d_block] block of rows of one batch*head, in the caller's
  layout [B, Tp, H, D]: batch*head n is batch n // heads, head n % heads.

  index(*program ids) -> (n, block index along T, block index along D).
  """

  def caller(*ids):
    n, t, d = index(*ids)
    return n // heads, t, n % heads, d

  return pl.BlockSpec((None, t_block, None, d_block), caller)


def ip_row(ip: jax.Array, width: int) -> jax.Array:
  """[BH] -> [BH, width]: the prior precision of every column, padded ones included."""
  return jnp.broadcast_to(ip[:, None], (ip.shape[0], width))


def from_head_major(x: jax.Array, b: int, h: int, t: int, d: int) -> jax.Array:
  """[B*H, Tp, Dp] -> [B, T, H, D] (drops padding)."""
  x = x[:, :t, :d].reshape(b, h, t, d)
  return jnp.transpose(x, (0, 2, 1, 3))


def state_to_head_major(s: jax.Array, v_pad: int, k_pad: int) -> jax.Array:
  """[B, H, V, K] -> [B*H, Vp, Kp] (zero padding)."""
  b, h, v, k = s.shape
  return jnp.pad(s.reshape(b * h, v, k), ((0, 0), (0, v_pad), (0, k_pad)))


def state_from_head_major(s: jax.Array, b: int, h: int, v: int, k: int) -> jax.Array:
  """[B*H, Vp, Kp] -> [B, H, V, K]."""
  return s[:, :v, :k].reshape(b, h, v, k)


def make_gates(log_alpha: jax.Array, starts: jax.Array | None, h: int,
               t_pad: int, chunk: int) -> Gates:
  """Gates from log_alpha [B, T, H] and segment starts [B, T] bool (or None)."""
  b, t, _ = log_alpha.shape
  la = jnp.transpose(log_alpha.astype(jnp.float32), (0, 2, 1)).reshape(b * h, t)
  la = jnp.pad(la, ((0, 0), (0, t_pad)))
  if starts is None:
    reset = jnp.zeros(la.shape, bool)
  else:
    reset = jnp.broadcast_to(starts[:, None, :], (b, h, t)).reshape(b * h, t)
    reset = jnp.pad(reset, ((0, 0), (0, t_pad)))
  step = step_gates(la, reset)
  bh, tp = la.shape
  nc = tp // chunk
  cum = jnp.cumsum(la.reshape(bh, nc, chunk), axis=-1)
  total = cum[..., -1:]
  to_end = jnp.exp(total - cum)
  chunk_gate = jnp.exp(total[..., 0])
  if starts is not None:
    # A restart strictly after t (inside the chunk) cuts the decay from t to the end.
    reset_c = reset.reshape(bh, nc, chunk).astype(jnp.int32)
    resets_from = jnp.flip(jnp.cumsum(jnp.flip(reset_c, -1), -1), -1)
    to_end = jnp.where(resets_from - reset_c > 0, 0.0, to_end)
    chunk_gate = jnp.where(resets_from[..., 0] > 0, 0.0, chunk_gate)
  return Gates(step=step, to_end=to_end.reshape(bh, tp), chunk=chunk_gate,
               reset=reset)
