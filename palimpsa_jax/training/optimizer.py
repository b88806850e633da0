"""The paper's optimizer: AdamW, linear warmup, cosine decay to a fraction of the peak, clipping.

Also the fine-tuning schedule that trains some parameters alone first
(train_new_parameters_first).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax


def learning_rate_schedule(config: ml_collections.ConfigDict,
                           total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to `config.learning_rate`, then cosine to `end_fraction` of it.

  Args:
    config: the optimizer config (learning_rate, end_fraction, decay_steps: the
      cosine's horizon, warmup included; None means total_steps. Fixing it lets a
      run be extended without changing its past schedule. warmup_fraction:
      the warmup's share of that horizon, so that warmup follows the run's
      actual length).
    total_steps: optimizer steps of the whole run (warmup included).
  """
  if total_steps <= 0:
    raise ValueError(f"total_steps must be positive, got {total_steps}.")
  horizon = config.decay_steps if config.decay_steps is not None else total_steps
  warmup = round(config.warmup_fraction * horizon)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=config.learning_rate,
      warmup_steps=warmup,
      decay_steps=max(horizon, warmup + 1),
      end_value=config.learning_rate * config.end_fraction)


def make_optimizer(config: ml_collections.ConfigDict, total_steps: int,
                   weight_decay_mask: Any,
                   schedule: optax.Schedule | None = None
                   ) -> optax.GradientTransformation:
  """Global-norm clipping followed by AdamW with the schedule above.

  Args:
    config: learning_rate, warmup_fraction, decay_steps, end_fraction, b1, b2, eps,
      weight_decay, clip_norm (<= 0 disables clipping).
    total_steps: optimizer steps of the whole run.
    weight_decay_mask: pytree of bools shaped like the parameters (True: decay)
      or a function params -> such a pytree.
    schedule: the learning rate per step; None: learning_rate_schedule(config,
      total_steps).
  """
  if schedule is None:
    schedule = learning_rate_schedule(config, total_steps)
  adamw = optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps,
                      weight_decay=config.weight_decay, mask=weight_decay_mask)
  if config.clip_norm is not None:
    return optax.chain(optax.clip_by_global_norm(config.clip_norm), adamw)
  return adamw


class NewFirstState(NamedTuple):
  count: jax.Array  # int32 [], optimizer steps taken
  inner: optax.OptState


def train_new_parameters_first(tx: optax.GradientTransformation, trainable: Any,
                               steps: int) -> optax.GradientTransformation:
  """`tx` whose updates to parameters not in `trainable` are zero for `steps` steps.

  The inner optimizer still sees every gradient, so the frozen parameters'
  moments are warm when they start training.

  Args:
    tx: the optimizer.
    trainable: pytree of bools shaped like the parameters (e.g.
      models.new_parameter_mask(params)), True where the parameter trains from
      step 0.
    steps: optimizer steps during which only `trainable` parameters change;
      0 returns `tx` unchanged.
  """
  if steps < 0:
    raise ValueError(f"steps must be >= 0, got {steps}")
  if steps == 0:
    return tx

  def init(params):
    return NewFirstState(jnp.zeros((), jnp.int32), tx.init(params))

  def update(updates, state, params=None):
    updates, inner = tx.update(updates, state.inner, params)
    frozen = state.count < steps
    updates = jax.tree.map(
        lambda u, train: u if train else jnp.where(frozen, jnp.zeros_like(u), u),
        updates, trainable)
    return updates, NewFirstState(jnp.minimum(state.count + 1, steps), inner)

  return optax.GradientTransformation(init, update)
