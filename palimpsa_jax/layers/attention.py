"""Transformer++ causal self-attention (RoPE, softmax via dot_product_attention)."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from palimpsa_jax.layers import params as params_lib
from palimpsa_jax.layers.checks import check_mixer_input
from palimpsa_jax.layers.diagnostics import rms
from palimpsa_jax.layers.linear import Dense
from palimpsa_jax.layers.readout import named_readout
from palimpsa_jax.layers.rope import apply_rope


class KVCache(NamedTuple):
  """Keys and values [B, S_max, H, D] and the number of filled positions []."""

  k: jax.Array
  v: jax.Array
  position: jax.Array


def check_cache_room(cache: KVCache, length: int) -> None:
  """Raises ValueError when `length` new tokens do not fit in the cache.

  The S_max bound is checked on the static shapes; position + length <= S_max
  only when cache.position is concrete (outside jit). Under jit the position is
  traced, and keeping it within S_max is the caller's job: beyond it,
  dynamic_update_slice would clamp and overwrite the last slots.
  """
  max_length = cache.k.shape[1]
  if length > max_length:
    raise ValueError(
        f"{length} new tokens do not fit in a KV cache of {max_length} positions; "
        "call init_cache with a larger max_length")
  try:
    position = int(cache.position)
  except jax.errors.ConcretizationTypeError:
    return
  if position + length > max_length:
    raise ValueError(
        f"the KV cache holds {position} of {max_length} positions: {length} new "
        "tokens do not fit; call init_cache with a larger max_length")


class Attention(nnx.Module):
  """Multi-head causal softmax attention, optional RoPE, no biases.

  implementation is passed to jax.nn.dot_product_attention: None or "xla"
  (portable), "cudnn" (fused GPU kernel, bf16/fp16).
  """

  def __init__(
      self, d_model: int, *, num_heads: int, head_dim: int, rngs: nnx.Rngs,
      rope: bool = True, rope_theta: float = 10000.0,
      implementation: str | None = None,
      init_std: float = params_lib.INIT_STD, dtype=jnp.float32):
    init = params_lib.normal_init(init_std)
    dense = lambda i, o, names: Dense(i, o, names=names, rngs=rngs,
                                      kernel_init=init, dtype=dtype)
    hd = num_heads * head_dim
    self.q_proj = dense(d_model, hd, ("embed", "heads"))
    self.k_proj = dense(d_model, hd, ("embed", "heads"))
    self.v_proj = dense(d_model, hd, ("embed", "heads"))
    self.out_proj = dense(hd, d_model, ("heads", "embed"))
    self.num_heads, self.head_dim = num_heads, head_dim
    self.d_model = d_model
    self.rope, self.rope_theta = rope, rope_theta
    self.implementation = implementation
    self.dtype = dtype

  def init_cache(self, batch_size: int, max_length: int,
                 dtype=jnp.float32) -> KVCache:
    """Empty KV cache of max_length positions."""
    shape = (batch_size, max_length, self.num_heads, self.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                   jnp.zeros((), jnp.int32))

  def _qkv(self, x, positions):
    check_mixer_input(x, self.d_model)
    batch, length, _ = x.shape
    shape = (batch, length, self.num_heads, self.head_dim)
    q = self.q_proj(x).reshape(shape)
    k = self.k_proj(x).reshape(shape)
    v = self.v_proj(x).reshape(shape)
    if self.rope:
      q = apply_rope(q, positions, self.rope_theta)
      k = apply_rope(k, positions, self.rope_theta)
    return q, k, v

  def _out(self, o):
    batch, length = o.shape[:2]
    return self.out_proj(o.reshape(batch, length, -1))

  def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None,
               return_diagnostics: bool = False):
    """x [B, T, d] -> y [B, T, d] (and a diagnostics dict when asked).

    With segment_ids [B, T], a token attends only within its segment.
    """
    length = x.shape[1]
    q, k, v = self._qkv(x, jnp.arange(length))
    if segment_ids is None:
      o = jax.nn.dot_product_attention(
          q, k, v, is_causal=True, implementation=self.implementation)
    else:
      same = segment_ids[:, :, None] == segment_ids[:, None, :]
      causal = jnp.tril(jnp.ones((length, length), jnp.bool_))
      o = jax.nn.dot_product_attention(
          q, k, v, mask=(same & causal)[:, None],
          implementation=self.implementation)
    y = self._out(named_readout(o))
    if return_diagnostics:
      return y, {"output_rms": rms(y)}
    return y

  def prefill(self, x: jax.Array, cache: KVCache):
    """Appends x [B, T, d] to the cache; returns (y [B, T, d], new cache).

    Raises ValueError when T exceeds the cache length S_max, or (outside jit)
    when position + T does; see check_cache_room.
    """
    length = x.shape[1]
    check_cache_room(cache, length)
    max_length = cache.k.shape[1]
    start = cache.position
    positions = start + jnp.arange(length)
    q, k, v = self._qkv(x, positions)
    k_all = jax.lax.dynamic_update_slice_in_dim(
        cache.k, k.astype(cache.k.dtype), start, axis=1)
    v_all = jax.lax.dynamic_update_slice_in_dim(
        cache.v, v.astype(cache.v.dtype), start, axis=1)
    mask = jnp.arange(max_length)[None, :] <= positions[:, None]  # [T, S]
    o = jax.nn.dot_product_attention(
        q, k_all.astype(q.dtype), v_all.astype(q.dtype),
        mask=mask[None, None])
    return self._out(o), KVCache(k_all, v_all, start + length)

  def step(self, x: jax.Array, cache: KVCache):
    """One token x [B, 1, d]; returns (y [B, 1, d], new cache).

    Under jit (e.g. generate's scan) the position is traced and not checked:
    the caller must stop before position reaches the cache length S_max.
    """
    return self.prefill(x, cache)
