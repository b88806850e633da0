"""The calling convention shared by the recurrent mixers."""

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


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

  Subclasses set `self.metaplasticity`, `self.num_heads` and, when metaplastic, the
  parameter `self.Ip_log` [H].
  """

  def prior_precision(self) -> jax.Array:
    """Ip [H] f32; Ip_log is frozen (no gradient), so Ip stays at its initial value."""
    if not self.metaplasticity:
      return jnp.ones((self.num_heads,), jnp.float32)
    return jnp.exp(jax.lax.stop_gradient(self.Ip_log[...]))
