"""The token loss's implementations by name: one table, one contract, and the order "auto"
tries them in (ops.dispatch).

`token_loss` runs the fn of an entry of IMPLEMENTATIONS as

    fn(h, table, targets, counted, *, precision)
    -> (nll [B, T], correct [B, T] bool, lse [B, T])

on validated arrays: h [B, T, d] and table [vocab, d] of one float dtype; targets [B, T] int,
in [0, vocab) where counted [B, T] bool is True; precision the matmul precision in force at the
call (jax.default_matmul_precision). nll is float32 (float64 for float64 h), 0 where not
counted; correct is whether the first maximal logit is the target, False where not counted;
lse is the log-sum-exp of the logits at every position, in nll's dtype. nll and lse carry the
gradients to h and table.
"""

from palimpsa_jax.ops.dispatch import ELSEWHERE, Implementation
from palimpsa_jax.ops.token_loss.logits import head_logits, losses_of_logits
from palimpsa_jax.ops.token_loss.sliced import sliced_losses


def _logits(h, table, targets, counted, *, precision):
  del precision  # head_logits reads it at the call, as the caller's context sets it.
  return losses_of_logits(head_logits(h, table), targets, counted)


def _sliced(h, table, targets, counted, *, precision):
  return sliced_losses(h, table, targets, counted, precision)


IMPLEMENTATIONS = {
    # The whole float32 logits, differentiated by autodiff.
    "logits": Implementation(_logits),
    # A slice of positions at a time, logits recomputed in the backward.
    "sliced": Implementation(_sliced),
}
# What "auto" runs, on every platform.
PREFERENCE = {ELSEWHERE: ("sliced",)}
