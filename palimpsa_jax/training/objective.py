"""The objective: what training minimises and what every step and scorer reports, from the
token loss's per-position outputs (ops.token_loss.TokenLoss: nll, correct, lse, weights).

Every consumer of the loss goes through this module: the train step differentiates
`Objective(loss)` and reports `means` of `metric_sums(loss)`; the eval step, the batched
trainer's steps and the MQAR suite sum `metric_sums` over batches and report their `means`; the
language-model scorer reads `position_metrics` per position. A new loss term is therefore a
change here (and in the run config that sets its coefficient): docs/where_changes_go.md walks
through one.

  objective = Objective.for_run(config)
  loss = model.token_losses(tokens, targets, weights)   # TokenLoss [B, T]
  minimised = objective(loss)                           # scalar: the gradient comes from it
  sums = metric_sums(loss)                              # [len(METRICS) + 1]: add over batches
  means(sums)                                           # {"loss": ..., "accuracy": ...}
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from palimpsa_jax.ops.token_loss import TokenLoss

# What every step reports, as means over the positions that count (weighted): "loss" is the
# cross-entropy, -log p(target); "accuracy" the fraction whose first maximal logit is the target.
METRICS = ("loss", "accuracy")


def position_metrics(loss: TokenLoss) -> dict[str, jax.Array]:
  """{name in METRICS: [B, T]} of one batch's TokenLoss (0 where a position does not count)."""
  return {"loss": loss.nll, "accuracy": loss.correct.astype(loss.nll.dtype)}


def metric_sums(loss: TokenLoss) -> jax.Array:
  """[len(METRICS) + 1] float32: each metric's weighted sum over the batch, then the weights'
  sum (the count). Sums of several batches (microbatches, evaluation batches) add up."""
  per_position = position_metrics(loss)
  sums = [jnp.sum(loss.weights * per_position[name]) for name in METRICS]
  return jnp.stack(sums + [jnp.sum(loss.weights)]).astype(jnp.float32)


def count(sums: Any) -> Any:
  """The weights' sum of `metric_sums`'s (or their total's) result."""
  return sums[len(METRICS)]


def means(sums: Any) -> dict[str, Any]:
  """{name in METRICS: mean} of `metric_sums`'s result, in a jitted step, or of their total
  on the host (numpy: in its dtype, so float64 sums give float64 means). With no position
  counted, the sums themselves, 0."""
  numbers = jnp if isinstance(sums, jax.Array) else np
  denominator = numbers.maximum(count(sums), 1.0)
  return {name: sums[i] / denominator for i, name in enumerate(METRICS)}


@dataclasses.dataclass(frozen=True)
class Objective:
  """The run's training objective: the weighted sum, over the positions that count, of each
  position's cross-entropy (-log p(target), TokenLoss.nll). A term added to the loss (a
  coefficient the run config sets) is a field here, read in `for_run` and added in
  `__call__`."""

  @classmethod
  def for_run(cls, config: ml_collections.ConfigDict) -> "Objective":
    """The objective of a run config (run_config/base.py): the cross-entropy alone, as no
    config field adds a term to it."""
    del config
    return cls()

  def __call__(self, loss: TokenLoss) -> jax.Array:
    """The scalar a train step differentiates (its mean over positions divides by
    count(metric_sums(loss)) once summed over microbatches)."""
    return jnp.sum(loss.weights * loss.nll)
