"""The token loss stated plainly, the oracle its implementations are tested against.

Runs in the dtype it is given: tests call it on float64 arrays inside `jax.enable_x64(True)`,
and differentiate it with jax.grad.
"""

import jax
import jax.numpy as jnp

from palimpsa_jax.ops.token_loss.types import TokenLoss


def token_loss_reference(h: jax.Array, table: jax.Array, targets: jax.Array,
                         weights: jax.Array) -> TokenLoss:
  """TokenLoss of h [B, T, d] against table [vocab, d] with weights [B, T] (float, >= 0)."""
  logits = jnp.einsum("btd,vd->btv", h, table, precision=jax.lax.Precision.HIGHEST)
  return logits_reference(logits, targets, weights)


def logits_reference(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> TokenLoss:
  """TokenLoss of logits [B, T, vocab]: log-softmax with the maximum subtracted, a one-hot pick."""
  counted = weights != 0
  top = jnp.max(logits, axis=-1, keepdims=True)
  shifted_lse = jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1, keepdims=True))
  log_probs = logits - top - shifted_lse
  one_hot = jnp.arange(logits.shape[-1]) == jnp.where(counted, targets, 0)[..., None]
  nll = jnp.where(counted, -jnp.sum(jnp.where(one_hot, log_probs, 0.0), axis=-1), 0.0)
  # The first maximal logit: the smallest index among those equal to the maximum.
  is_max = logits == jnp.max(logits, axis=-1, keepdims=True)
  first = jnp.min(jnp.where(is_max, jnp.arange(logits.shape[-1]), logits.shape[-1]), axis=-1)
  correct = counted & (first == targets)
  return TokenLoss(nll, correct, (top + shifted_lse)[..., 0], weights.astype(nll.dtype))
