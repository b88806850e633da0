"""Fast Palimpsa token by token from a cache, for decoding.

The approximation is defined on chunks starting at steps 0, C, 2C, ... of the sequence, and a
token's output reads the frozen start of its chunk and the chunk's earlier tokens. The cache
keeps exactly that (reference.py's per-step carry, the chunk's frozen start and the position in
the chunk), so a prompt run through `fast_palimpsa_decode` in pieces of any length and then
one token at a time gives the outputs of `fast_palimpsa` on the whole sequence.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from palimpsa_jax.ops.fast_palimpsa.reference import ChunkStart, InChunk, chunk_start, step
from palimpsa_jax.ops.palimpsa_contract import PalimpsaState


class FastPalimpsaCache(NamedTuple):
  """Decode state of one layer, float32.

  start: ChunkStart of the current chunk (read only while position > 0).
  carry: InChunk after the last token; carry.mu, carry.precision: the exact state.
  position: int32 [], tokens of the current chunk seen; 0: the next token starts a chunk.
  """

  start: ChunkStart
  carry: InChunk
  position: jax.Array

  @property
  def state(self) -> PalimpsaState:
    """The exact posterior after the last token."""
    return PalimpsaState(self.carry.mu, self.carry.precision)


def init_fast_palimpsa_cache(state: PalimpsaState) -> FastPalimpsaCache:
  """A cache at a chunk boundary holding `state` (mu, precision [B, H, V, K])."""
  mu = state.mu.astype(jnp.float32)
  precision = state.precision.astype(jnp.float32)
  # The marginals of this start are rebuilt with the true prior by the first token.
  start, carry = chunk_start(mu, precision, jnp.ones((1, mu.shape[1], 1, 1), jnp.float32))
  return FastPalimpsaCache(start, carry, jnp.zeros((), jnp.int32))


def fast_palimpsa_decode(q, k, v, beta, log_alpha, prior_precision, cache: FastPalimpsaCache,
                         *, chunk_size: int) -> tuple[jax.Array, FastPalimpsaCache]:
  """Runs T tokens from the cache; returns (out [B, T, H, V] dtype of v, new cache).

  q, k [B, T, H, K]; v [B, T, H, V]; beta [B, T, H, V] or None (0); log_alpha [B, T, H];
  prior_precision [H]. One step per token (O(V * K) each), in float32.
  """
  ip = prior_precision.astype(jnp.float32)[None, :, None, None]
  if beta is None:
    beta = jnp.zeros_like(v)

  def one_token(state, x):
    start, carry, position = state
    fresh_start, fresh_carry = chunk_start(carry.mu, carry.precision, ip)
    begins = position == 0
    start, carry = jax.tree.map(lambda a, b: jnp.where(begins, a, b), (fresh_start, fresh_carry),
                                (start, carry))
    carry, (out, _) = step(start, carry, *x, ip)
    return (start, carry, (position + 1) % chunk_size), out

  time_major = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)
  xs = tuple(map(time_major, (q, k, v, beta))) + (time_major(jnp.exp(log_alpha)),)
  (start, carry, position), out = jax.lax.scan(one_token, tuple(cache), xs)
  return jnp.moveaxis(out, 0, 1).astype(v.dtype), FastPalimpsaCache(start, carry, position)
