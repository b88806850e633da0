"""Causal depthwise short convolution with a decode state."""

import functools

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
    # The weights in the compute dtype, widened to float32 where the taps are summed.
    widen = lambda w: None if w is None else w[...].astype(self.dtype).astype(jnp.float32)
    weights = (widen(self.kernel), widen(self.bias))
    convolve = functools.partial(_convolve, activation=self.activation, dtype=self.dtype)
    if width > 1 and context_parallel.active() is not None:
      y = context_parallel.with_halo(convolve, x, state, segment_ids, weights, width - 1)
    else:
      halo_ids = (None if segment_ids is None
                  else jnp.repeat(segment_ids[:, :1], width - 1, axis=1))
      y = convolve(x, state, halo_ids, segment_ids, *weights)
    # The last W - 1 inputs, from x and (when x is shorter than that) the state before it.
    recent = jnp.concatenate([state, x[:, -(width - 1):].astype(jnp.float32)], axis=1)
    return y, recent[:, recent.shape[1] - (width - 1):]


def _convolve(x, halo, halo_ids, segment_ids, kernel, bias, *, activation, dtype):
  """y [B, L, C] in dtype from x [B, L, C] and the W - 1 inputs before it.

  halo [B, W-1, C] f32; halo_ids [B, W-1] with segment_ids [B, L], or both None; kernel
  [W, C] and bias [C] (or None) float32.
  """
  return _conv(x, halo, kernel, bias, halo_ids, segment_ids, activation, jnp.dtype(dtype))


# Each tap reads x (often bfloat16) shifted and widens it to float32 where it is summed,
# forward and backward: no float32 copy of x, of the taps or of their sum is written to
# memory. Autodiff of the float32 formula kept W + 3 float32 copies of x, and even under
# jax.checkpoint its backward wrote W float32 products per tap to memory for the weight
# gradient (docs/gpu_performance.md, "The layer around the op").
@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _conv(x, halo, kernel, bias, halo_ids, segment_ids, activation, dtype):
  pre = _pre_activation(x, halo, kernel, bias, halo_ids, segment_ids, 0)
  return (jax.nn.silu(pre) if activation else pre).astype(dtype)


def _conv_fwd(x, halo, kernel, bias, halo_ids, segment_ids, activation, dtype):
  y = _conv(x, halo, kernel, bias, halo_ids, segment_ids, activation, dtype)
  return y, (x, halo, kernel, bias, halo_ids, segment_ids)


def _conv_bwd(activation, dtype, residuals, dy):
  """Cotangents of x, halo, kernel and bias from dy [B, L, C] (dpre: dy through the SiLU).

  dx[s] = sum_i w_i dpre[s + W-1-i] is one fusion that recomputes dpre at the W shifts
  from x and dy; the weights' sums read dpre once (XLA writes it in float32).
  """
  del dtype
  x, halo, kernel, bias, halo_ids, segment_ids = residuals
  width, length = kernel.shape[0], x.shape[1]
  masked = functools.partial(_masked, halo_ids, segment_ids)
  d_pre = lambda shift: _through_activation(
      _pre_activation(x, halo, kernel, bias, halo_ids, segment_ids, shift),
      _ahead(dy, shift), activation)
  # Tap i of the output at s + W-1-i read x at s.
  dx = sum(masked(i, width - 1 - i, d_pre(width - 1 - i) * kernel[i]) for i in range(width))
  # The halo's cotangent: halo position h was read by tap i of the output at h - i.
  d_halo = jnp.zeros_like(halo)
  head = min(width - 1, length)
  if head:
    head_ids = None if segment_ids is None else segment_ids[:, :head]
    d_pre_head = _through_activation(
        _pre_activation(x[:, :head], halo, kernel, bias, halo_ids, head_ids, 0),
        dy[:, :head], activation)
    for i in range(width - 1):
      read = _masked(halo_ids, head_ids, i, 0, d_pre_head * kernel[i])[:, :width - 1 - i]
      d_halo = d_halo.at[:, i:i + read.shape[1]].add(read)
  # One reduction for every weight.
  d_pre0 = d_pre(0)
  summands = [masked(i, 0, d_pre0 * _x_at(x, halo, i - (width - 1))) for i in range(width)]
  if bias is not None:
    summands.append(d_pre0)
  # Summed over [B * L] rows of W (+1) x C: a reduction over the major dimension of a 2-d
  # array keeps x's layout; over (B, L) of [B, L, W, C], XLA made x channel-major to
  # reduce the minor dimensions, and transposed the stacked inputs to match.
  stacked = jnp.stack(summands, axis=2)
  sums = jnp.sum(stacked.reshape(-1, stacked.shape[2] * stacked.shape[3]), axis=0)
  sums = sums.reshape(stacked.shape[2:])
  d_bias = None if bias is None else sums[width]
  return dx.astype(x.dtype), d_halo.astype(halo.dtype), sums[:width], d_bias, None, None


_conv.defvjp(_conv_fwd, _conv_bwd)


def _x_at(x, halo, shift):
  """x at t + shift for t in [0, L), float32 [B, L, C]: the halo's inputs before the start
  (shift >= -(W-1)), zeros past the end."""
  xf = x.astype(jnp.float32)
  if shift < 0:
    length = x.shape[1]
    return jnp.concatenate([halo[:, halo.shape[1] + shift:], xf], axis=1)[:, :length]
  return _ahead(xf, shift)


def _ahead(a, shift):
  """a [B, L, ...] at t + shift (shift >= 0) in float32, zeros past the end."""
  a = a.astype(jnp.float32)
  if shift == 0:
    return a
  pad = jnp.zeros((a.shape[0], shift, *a.shape[2:]), jnp.float32)
  return jnp.concatenate([a[:, shift:], pad], axis=1)[:, :a.shape[1]]


def _masked(halo_ids, segment_ids, tap, shift, value):
  """value [B, L, C] where tap `tap` of the output at t + shift reads that output's own
  segment, else 0 (value itself without segments)."""
  if segment_ids is None or tap == halo_ids.shape[1]:
    return value
  length = value.shape[1]
  ids = jnp.concatenate([halo_ids, segment_ids], axis=1)
  own = segment_ids[:, shift:shift + length]
  same = ids[:, tap + shift:tap + shift + own.shape[1]] == own
  # Past the end (shift > 0) nothing is read.
  same = jnp.pad(same, ((0, 0), (0, length - own.shape[1])))
  return jnp.where(same[..., None], value, 0.0)


def _pre_activation(x, halo, kernel, bias, halo_ids, segment_ids, shift):
  """sum_i w_i x[t + shift - (W-1) + i] (+ b) for t in [0, L), float32 [B, L, C]; a tap
  reading another segment adds nothing."""
  width = kernel.shape[0]
  y = 0.0
  for i in range(width):
    tap = _x_at(x, halo, shift + i - (width - 1)) * kernel[i]
    y = y + _masked(halo_ids, segment_ids, i, shift, tap)
  return y if bias is None else y + bias


def _through_activation(pre, dy, activation):
  """dy [B, L, C] (float32) through the SiLU at pre."""
  dy = dy.astype(jnp.float32)
  if not activation:
    return dy
  sigmoid = jax.nn.sigmoid(pre)
  return dy * sigmoid * (1.0 + pre * (1.0 - sigmoid))
