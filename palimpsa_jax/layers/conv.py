"""Causal depthwise short convolution with a decode state."""

import jax
import jax.numpy as jnp
from flax import nnx

from palimpsa_jax.layers import params as params_lib
from palimpsa_jax.ops import context_parallel


class ShortConv(nnx.Module):
  """Causal depthwise conv over time, optional bias, optional SiLU.

  y[t, c] = sum_i w[i, c] * x[t - (W - 1) + i, c] (+ b[c]); inputs before the
  sequence come from `state` (the last W - 1 inputs, zeros at the start), and
  with segment_ids an input from another segment contributes nothing. With time
  split over a sequence axis (ops.context_parallel), each shard receives the
  W - 1 inputs before it from its neighbour.
  """

  def __init__(
      self, channels: int, kernel_size: int = 4, *, rngs: nnx.Rngs,
      use_bias: bool = False, activation: bool = True,
      channel_name: str | None = "heads", dtype=jnp.float32):
    if kernel_size < 1:
      raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
    init = params_lib.fan_in_uniform_init(kernel_size)
    self.kernel = params_lib.make_param(
        init(rngs.params(), (kernel_size, channels)), ("conv", channel_name))
    self.bias = (params_lib.make_param(
        init(rngs.params(), (channels,)), (channel_name,))
                 if use_bias else None)
    self.channels = channels
    self.kernel_size = kernel_size
    self.activation = activation
    self.dtype = dtype

  def init_state(self, batch_size: int) -> jax.Array:
    """Zero state [B, W - 1, C] float32."""
    return jnp.zeros((batch_size, self.kernel_size - 1, self.channels),
                     jnp.float32)

  def __call__(
      self, x: jax.Array, state: jax.Array | None = None,
      segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x [B, T, C] -> (y [B, T, C] in `dtype`, new state [B, W - 1, C])."""
    batch, _, channels = x.shape
    if channels != self.channels:
      raise ValueError(f"x must be [B, T, {self.channels}], got {x.shape}")
    if state is None:
      state = self.init_state(batch)
    width = self.kernel_size
    weights = (self.kernel[...], None if self.bias is None else self.bias[...])
    # The backward recomputes the taps and the SiLU from x (in the caller's dtype, often
    # bfloat16): autodiff of the float32 forward kept each shifted tap, their sum and the
    # SiLU's internals, W + 3 float32 copies of x.
    convolve = jax.checkpoint(self._convolve)
    if width > 1 and context_parallel.active() is not None:
      y = context_parallel.with_halo(convolve, x, state, segment_ids, weights, width - 1)
    else:
      halo_ids = (None if segment_ids is None
                  else jnp.repeat(segment_ids[:, :1], width - 1, axis=1))
      y = convolve(x, state, halo_ids, segment_ids, *weights)
    # The last W - 1 inputs, from x and (when x is shorter than that) the state before it.
    recent = jnp.concatenate([state, x[:, -(width - 1):].astype(jnp.float32)], axis=1)
    return y, recent[:, recent.shape[1] - (width - 1):]

  def _convolve(self, x, halo, halo_ids, segment_ids, kernel, bias):
    """y [B, L, C] in `dtype` from x [B, L, C] and the W - 1 inputs before it.

    halo [B, W-1, C] f32; halo_ids [B, W-1] (with segment_ids [B, L]) or None. Each tap
    reads x (often bfloat16) shifted, behind its own part of the halo, and widens it to
    float32 where it is summed: no float32 copy of the padded input is written to memory.
    """
    length = x.shape[1]
    width = self.kernel_size
    kernel = kernel.astype(self.dtype).astype(jnp.float32)
    if segment_ids is not None:
      seg = jnp.concatenate([halo_ids, segment_ids], 1)
    y = jnp.zeros(x.shape, jnp.float32)
    for i in range(width):
      # Tap i reads the input W - 1 - i steps back: halo[:, i:] then x, cut to L.
      shifted = jnp.concatenate([halo[:, i:], x.astype(jnp.float32)], axis=1)[:, :length]
      tap = shifted * kernel[i]
      if segment_ids is not None and i < width - 1:
        same = seg[:, i:i + length] == segment_ids
        tap = jnp.where(same[..., None], tap, 0.0)
      y = y + tap
    if bias is not None:
      y = y + bias.astype(self.dtype).astype(jnp.float32)
    if self.activation:
      y = jax.nn.silu(y)
    return y.astype(self.dtype)
