"""Jitted train and eval steps (no host synchronisation inside)."""

from collections.abc import Callable
import contextlib
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from palimpsa_jax import models
from palimpsa_jax.data.mqar import IGNORE_INDEX
from palimpsa_jax.ops.token_loss import TokenLoss
from palimpsa_jax.training import objective as objective_lib

Batch = dict[str, jax.Array]
# () -> the context the steps are traced in (sharding_lib.kernel_context).
KernelContext = Callable[[], contextlib.AbstractContextManager]


def _traced_within(kernel_context: KernelContext, fn: Callable) -> Callable:
  """fn, entering kernel_context() whenever it runs (i.e. while jit traces it)."""
  @functools.wraps(fn)
  def wrapped(*args):
    with kernel_context():
      return fn(*args)
  return wrapped


def token_losses(graphdef: Any, params: dict, model_state: dict, batch: Batch) -> TokenLoss:
  """The token loss of a batch's targets [B, T]; with batch["positions"] [B, P], only there.

  "positions" must hold every position whose target counts (MQAR's query positions), so the
  objective's sums equal those over the whole sequence. A target counts unless it is
  IGNORE_INDEX; the loss is the model's token_losses (the token_loss op on the final hidden
  states, without the whole float32 logits in memory).
  """
  model = models.merge_model(graphdef, params, model_state)
  positions = batch.get("positions")
  targets = batch["targets"]
  if positions is not None:
    targets = models.take_positions(targets, positions)
  return model.token_losses(batch["tokens"], targets, targets != IGNORE_INDEX,
                            segment_ids=batch.get("segment_ids"), positions=positions)


def _microbatches(batch: Batch, count: int) -> Batch:
  """[B, ...] -> [count, B // count, ...]; microbatch i takes rows i, i+count, ...

  Interleaving keeps each microbatch spread over all batch shards.
  """
  def split(x):
    x = x.reshape((x.shape[0] // count, count) + x.shape[1:])
    return jnp.moveaxis(x, 1, 0)
  return jax.tree.map(split, batch)


def train_step_fn(graphdef: Any, tx: optax.GradientTransformation,
                  schedule: optax.Schedule, objective: objective_lib.Objective,
                  grad_accum_steps: int = 1
                  ) -> Callable[[dict, Batch], tuple[dict, dict]]:
  """The un-jitted `step(state, batch) -> (state, metrics)` of make_train_step.

  training/batched.py vmaps it over runs.
  """
  if grad_accum_steps < 1:
    raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}.")

  def sums_and_grads(params, model_state, batch):
    def minimised(p):
      loss = token_losses(graphdef, p, model_state, batch)
      return objective(loss), objective_lib.metric_sums(loss)
    (_, sums), grads = jax.value_and_grad(minimised, has_aux=True)(params)
    return grads, sums

  def step(state, batch):
    params, model_state = state["params"], state["model_state"]
    if grad_accum_steps == 1:
      grads, sums = sums_and_grads(params, model_state, batch)
    else:
      def body(carry, micro):
        grads, sums = sums_and_grads(params, model_state, micro)
        return jax.tree.map(jnp.add, carry, (grads, sums)), None
      zeros = (jax.tree.map(jnp.zeros_like, params),
               jnp.zeros((len(objective_lib.METRICS) + 1,), jnp.float32))
      (grads, sums), _ = jax.lax.scan(
          body, zeros, _microbatches(batch, grad_accum_steps))
    denominator = jnp.maximum(objective_lib.count(sums), 1.0)
    grads = jax.tree.map(lambda g: g / denominator, grads)
    metrics = {f"train/{name}": value for name, value in objective_lib.means(sums).items()}
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    new_state = {"step": state["step"] + 1,
                 "params": optax.apply_updates(params, updates),
                 "model_state": model_state,
                 "opt_state": opt_state}
    metrics.update({"train/grad_norm": grad_norm,
                    "train/lr": jnp.asarray(schedule(state["step"]), jnp.float32),
                    "train/finite": (jnp.isfinite(metrics["train/loss"])
                                     & jnp.isfinite(grad_norm))})
    return new_state, metrics

  return step


def make_train_step(graphdef: Any, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, objective: objective_lib.Objective,
                    state_shardings: dict, metric_sharding: Any, grad_accum_steps: int = 1,
                    kernel_context: KernelContext = contextlib.nullcontext
                    ) -> Callable[[dict, Batch], tuple[dict, dict]]:
  """Returns jitted `step(state, batch) -> (state, metrics)`; `state` is donated.

  The step is traced inside kernel_context() (for every step maker here), so
  Pallas kernels run per device shard (training.sharding.kernel_context).

  The gradient is that of `objective` (training/objective.py) divided by the count of
  targets of the global batch, also when the batch is processed in `grad_accum_steps`
  microbatches. Metrics: train/<name> for each of objective.METRICS (train/loss,
  train/accuracy: means over every counted target), train/grad_norm (before clipping),
  train/lr (used by this update), train/finite (loss and gradient finite).
  """
  step = train_step_fn(graphdef, tx, schedule, objective, grad_accum_steps)
  return jax.jit(_traced_within(kernel_context, step), donate_argnums=0,
                 out_shardings=(state_shardings, metric_sharding),
                 compiler_options=models.TRAIN_STEP_COMPILER_OPTIONS)


def eval_sums(graphdef: Any, params: dict, model_state: dict, batch: Batch
              ) -> jax.Array:
  """objective.metric_sums of one evaluation batch (un-jitted): add them over batches, then
  take objective.means."""
  return objective_lib.metric_sums(token_losses(graphdef, params, model_state, batch))


def make_eval_step(graphdef: Any, metric_sharding: Any,
                   kernel_context: KernelContext = contextlib.nullcontext
                   ) -> Callable[[dict, dict, Batch], jax.Array]:
  """Returns jitted `eval_step(params, model_state, batch) -> eval_sums(...)`."""
  def eval_step(params: dict, model_state: dict, batch: Batch) -> jax.Array:
    return eval_sums(graphdef, params, model_state, batch)

  return jax.jit(_traced_within(kernel_context, eval_step), out_shardings=metric_sharding)


def diagnostics(graphdef: Any, params: dict, model_state: dict, batch: Batch
                ) -> dict[str, jax.Array]:
  """{name: scalar} of the mixers' per-layer diagnostics on a batch (un-jitted).

  Names are "diag/layer<i>/<statistic>" from the mixers' diagnostics (for
  Palimpsa: precision mean/std, metaplastic fraction, ...); layers without
  diagnostics are skipped.
  """
  model = models.merge_model(graphdef, params, model_state)
  _, per_layer = model(batch["tokens"], segment_ids=batch.get("segment_ids"),
                       return_diagnostics=True)
  out = {}
  for index, layer in enumerate(per_layer):
    for name, value in (layer or {}).items():
      out[f"diag/layer{index}/{name}"] = jnp.mean(value).astype(jnp.float32)
  return out


def make_diagnostics_step(graphdef: Any, metric_sharding: Any,
                          kernel_context: KernelContext = contextlib.nullcontext
                          ) -> Callable[[dict, dict, Batch], dict[str, jax.Array]]:
  """Returns jitted `diagnostics(params, model_state, batch) -> {name: scalar}`
  (see `diagnostics`)."""
  return jax.jit(_traced_within(kernel_context, functools.partial(diagnostics, graphdef)),
                 out_shardings=metric_sharding)
