"""What `token_loss` and `logits_token_loss` return."""

from typing import NamedTuple

import jax


class TokenLoss(NamedTuple):
  """The token loss's per-position outputs, [B, T] each.

  nll:     float32 (float64 for float64 inputs): -log p(target), the negated log-probability
           of the target; 0 where the weight is 0. Gradients flow through it.
  correct: bool: whether the first maximal logit is the target; False where the weight is 0.
  lse:     nll's dtype: log-sum-exp of the position's logits (the log of the softmax's
           normaliser), at every position. Gradients flow through it.
  weights: nll's dtype: the weight each position counts with (the caller's weights; 1 for
           every position without them), 0 where it does not count.

  The op sums nothing: what a step minimises and reports is a weighted sum of these
  (palimpsa_jax/training/objective.py).
  """

  nll: jax.Array
  correct: jax.Array
  lse: jax.Array
  weights: jax.Array
