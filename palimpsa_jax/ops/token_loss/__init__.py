"""The token loss: next-token cross-entropy, argmax hits and log-probabilities of a tied head.

For final hidden states h [B, T, d] and an output embedding table [vocab, d], the logits are
h @ table^T accumulated in float32; for targets [B, T] and weights [B, T] (a bool mask or
non-negative floats; None: every target counts) the op returns each position's
nll = -log softmax(logits)[target] and whether the first maximal logit is the target, and their
weighted sums. `token_loss` starts from h and the table (its implementations never need the
whole logits at once); `logits_token_loss` starts from logits a caller already holds.
"""

from palimpsa_jax.ops.token_loss.api import logits_token_loss, token_loss
from palimpsa_jax.ops.token_loss.logits import head_logits
from palimpsa_jax.ops.token_loss.types import TokenLoss

__all__ = ["TokenLoss", "head_logits", "logits_token_loss", "token_loss"]
