"""`token_loss` and `logits_token_loss`: the public op. They validate, turn the weights into the
positions that count and run an implementation of the table in implementations.py (or the loss
of given logits)."""

import jax
import jax.numpy as jnp

from palimpsa_jax.ops import dispatch
from palimpsa_jax.ops.token_loss.implementations import IMPLEMENTATIONS, PREFERENCE
from palimpsa_jax.ops.token_loss.logits import losses_of_logits
from palimpsa_jax.ops.token_loss.types import TokenLoss
from palimpsa_jax.ops.token_loss.validation import validate_logits_args, validate_token_loss_args


def token_loss(h: jax.Array, table: jax.Array, targets: jax.Array,
               weights: jax.Array | None = None, *,
               implementation: str = "sliced") -> TokenLoss:
  """Next-token loss of the logits h @ table^T (products accumulated in float32).

  Args:
    h: [B, T, d] final hidden states (after the final norm), float32 or bfloat16.
    table: [vocab, d] output embedding, in h's dtype.
    targets: [B, T] int, in [0, vocab) wherever the weight is not 0 (any value elsewhere).
    weights: [B, T] bool mask or non-negative floats; None: every target counts with weight 1.
    implementation: "sliced" (a slice of positions at a time: the default, never the whole
      float32 logits unless they fit sliced.SLICE_LOGITS), "logits" (the whole logits) or
      "auto" ("sliced").

  Returns:
    TokenLoss (types.py): per position. Gradients flow to h and table through nll and lse; the
    backward rounds the logits' cotangent to h's dtype before its two matmuls, and both
    directions take the matmul precision in force at the call (jax.default_matmul_precision).
  """
  validate_token_loss_args(h, table, targets, weights, implementation)
  counted, weights = _counted(weights, targets.shape)
  # A custom backward is traced after the caller's forward: it takes the matmul precision in
  # force now, as autodiff's own matmuls would.
  nll, correct, lse = dispatch.run(IMPLEMENTATIONS, implementation, PREFERENCE,
                                   (h, table, targets, counted),
                                   dict(precision=jax.config.jax_default_matmul_precision))
  return TokenLoss(nll, correct, lse, weights.astype(nll.dtype))


def logits_token_loss(logits: jax.Array, targets: jax.Array,
                      weights: jax.Array | None = None) -> TokenLoss:
  """The same loss from logits [B, T, vocab] a caller already holds (computed in float32 or wider).

  targets and weights as in `token_loss`; gradients flow to the logits by autodiff through nll
  and lse.
  """
  validate_logits_args(logits, targets, weights)
  counted, weights = _counted(weights, targets.shape)
  logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
  nll, correct, lse = losses_of_logits(logits, targets, counted)
  return TokenLoss(nll, correct, lse, weights.astype(nll.dtype))


def _counted(weights, shape) -> tuple[jax.Array, jax.Array]:
  """(counted [B, T] bool, weights [B, T]) of the caller's weights (None: all ones)."""
  if weights is None:
    return jnp.ones(shape, bool), jnp.ones(shape, jnp.float32)
  if weights.dtype == jnp.bool_:
    return weights, weights.astype(jnp.float32)
  return weights != 0, weights

