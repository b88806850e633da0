"""The calling convention shared by the recurrent mixers."""

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from palimpsa_jax.layers.readout import named_readout
from palimpsa_jax.ops import PalimpsaResult, PalimpsaState, fast_palimpsa, palimpsa
from palimpsa_jax.ops.fast_palimpsa import fast_palimpsa_decode, init_fast_palimpsa_cache

# How a metaplastic mixer reads its memory: "exact" is the Palimpsa op; "rank1" is Fast
# Palimpsa, a rank-1 precision inside chunks of the mixer's chunk_size (docs/fast_palimpsa.md).
PRECISIONS = ("exact", "rank1")


def check_precision(precision: str) -> None:
  if precision not in PRECISIONS:
    raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}.")


class RecurrentMixer(nnx.Module):
  """Forward, prefill and single-step decoding around one `_forward`.

  Subclasses set `self.implementation` (the op implementation for whole sequences) and
  define `_forward(x, cache, segment_ids, implementation, return_diagnostics)` returning
  (y [B, T, d], new cache or None, diagnostics dict or None). Single steps always use the
  op's "sequential" implementation.
  """

  def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None,
               return_diagnostics: bool = False):
    """x [B, T, d] -> y [B, T, d] (and a diagnostics dict when asked)."""
    y, _, diagnostics = self._forward(
        x, None, segment_ids, self.implementation, return_diagnostics)
    return (y, diagnostics) if return_diagnostics else y

  def prefill(self, x: jax.Array, cache: Any):
    """Runs x [B, T, d] from the cache; returns (y [B, T, d], new cache)."""
    y, cache, _ = self._forward(x, cache, None, self.implementation, False)
    return y, cache

  def step(self, x: jax.Array, cache: Any):
    """One token x [B, 1, d]; returns (y [B, 1, d], new cache)."""
    y, cache, _ = self._forward(x, cache, None, "sequential", False)
    return y, cache


class MetaplasticMixer(RecurrentMixer):
  """A recurrent mixer on the Palimpsa op, with a `metaplasticity` flag and a frozen Ip_log.

  Subclasses set `self.metaplasticity`, `self.num_heads`, `self.precision` (one of
  PRECISIONS), `self.chunk_size` and, when metaplastic, the parameter `self.Ip_log` [H].
  """

  def _initial_memory(self, batch_size: int, value_dim: int, key_dim: int):
    """The cache's memory before any token: the prior as a PalimpsaState ("exact") or as a
    Fast Palimpsa decode cache at a chunk boundary ("rank1")."""
    shape = (batch_size, self.num_heads, value_dim, key_dim)
    ip = self.prior_precision()[None, :, None, None]
    state = PalimpsaState(jnp.zeros(shape, jnp.float32), jnp.broadcast_to(ip, shape))
    return state if self.precision == "exact" else init_fast_palimpsa_cache(state)

  def _memory(self, q, k, v, beta, log_alpha, memory, segment_ids, return_variance,
              implementation) -> tuple[PalimpsaResult, Any]:
    """Runs the op on [B, T, H, .] inputs from the cache's memory (None: the prior).

    Returns (PalimpsaResult, the cache's new memory). "rank1" runs Fast Palimpsa's matmul
    form on whole sequences and its cached decode from a cache, so that prefill and single
    steps compute what the whole-sequence forward computes.
    """
    ip = self.prior_precision()
    if self.precision == "exact":
      result = palimpsa(q, k, v, beta, log_alpha, ip, initial_state=memory,
                        segment_ids=segment_ids, return_variance=return_variance,
                        implementation=implementation, chunk_size=self.chunk_size)
      return result._replace(out=named_readout(result.out)), result.state
    if memory is None:
      result = fast_palimpsa(q, k, v, beta, log_alpha, ip, segment_ids=segment_ids,
                             return_variance=return_variance, chunk_size=self.chunk_size)
      return result._replace(out=named_readout(result.out)), result.state
    out, memory = fast_palimpsa_decode(q, k, v, beta, log_alpha, ip, memory,
                                       chunk_size=self.chunk_size)
    return PalimpsaResult(out, None, memory.state), memory

  def prior_precision(self) -> jax.Array:
    """Ip [H] f32; Ip_log is frozen (no gradient), so Ip stays at its initial value."""
    if not self.metaplasticity:
      return jnp.ones((self.num_heads,), jnp.float32)
    return jnp.exp(jax.lax.stop_gradient(self.Ip_log[...]))
