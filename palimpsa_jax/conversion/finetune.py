"""Fine-tuning a converted model: which parameters are new, and training them first."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from palimpsa_jax import models
from palimpsa_jax.conversion.surgery import NEW_PARAMETER_NAMES


def new_parameter_mask(params: Any) -> Any:
  """True for the metaplastic parameters (beta_down, beta_up, b_scale, Ip_log)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: any(n in NEW_PARAMETER_NAMES for n in models.path_names(path)), params)


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
      new_parameter_mask(params)), True where the parameter trains from step 0.
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
