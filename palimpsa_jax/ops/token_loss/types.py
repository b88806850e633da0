"""What `token_loss` and `logits_token_loss` return."""

from typing import NamedTuple

import jax


class TokenLoss(NamedTuple):
  """Per-position losses and their weighted sums.

  nll:      [B, T] float32 (float64 for float64 inputs): -log p(target), the negated
            log-probability of the target; 0 where the weight is 0.
  correct:  [B, T] bool: whether the first maximal logit is the target; False where the
            weight is 0.
  loss_sum: scalar, sum of weight * nll (what gradients flow through).
  hits:     scalar, sum of weight * correct.
  count:    scalar, sum of weight.
  """

  nll: jax.Array
  correct: jax.Array
  loss_sum: jax.Array
  hits: jax.Array
  count: jax.Array
