"""train_and_evaluate: train.py's run (MQAR and language modelling), a group of one in the
training loop (training/loop.py), with its state sharded over the mesh."""

from collections.abc import Callable, Sequence
import os
import time
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from palimpsa_jax import models
from palimpsa_jax import user_errors
from palimpsa_jax.data import tasks as tasks_lib
from palimpsa_jax.run_config import base
from palimpsa_jax.training import bookkeeping
from palimpsa_jax.training import checkpoint as checkpoint_lib
from palimpsa_jax.training import compile_cache
from palimpsa_jax.training import loop
from palimpsa_jax.training import objective as objective_lib
from palimpsa_jax.training import optimizer as optimizer_lib
from palimpsa_jax.training import sharding as sharding_lib
from palimpsa_jax.training import state as state_lib
from palimpsa_jax.training import steps as steps_lib
from palimpsa_jax.training import workdir_lock

# What building the model or tracing it raises for a config it cannot run (an op
# implementation or dtype name, a shape the op refuses, a kernel that cannot be imported).
_MODEL_REFUSALS = (ValueError, TypeError, NotImplementedError, ImportError)


class NonFiniteError(FloatingPointError, user_errors.UserError):
  """Raised when the loss or the gradient norm stops being finite."""


def make_tx_fn(config: ml_collections.ConfigDict, total_steps: int
               ) -> Callable[[Any], optax.GradientTransformation]:
  """abstract params -> the run's optimizer.

  With config.optimizer.new_params_only_steps > 0 (fine-tuning a converted
  model), only the new metaplastic parameters change during those first steps.
  """
  def make_tx(abstract_params):
    tx = optimizer_lib.make_optimizer(config.optimizer, total_steps,
                                      models.weight_decay_mask)
    new_first = config.optimizer.new_params_only_steps
    if not new_first:
      return tx
    return optimizer_lib.train_new_parameters_first(
        tx, models.new_parameter_mask(abstract_params), new_first)

  return make_tx


def initial_state(spec: state_lib.TrainStateSpec,
                  config: ml_collections.ConfigDict) -> dict:
  """The step-0 train state: freshly initialised, or config.init_from's parameters.

  config.init_from names a conversion output (configs/finetune.py): its
  parameters are restored directly onto the train state's shardings, with a
  fresh optimizer state, and the model is not randomly initialised first.
  """
  init_from = config.init_from
  if not init_from:
    return spec.init()
  if jax.tree.leaves(spec.abstract["model_state"]):
    raise ValueError(
        f"config.init_from={init_from!r} holds parameters only, but this model "
        "also has non-parameter variables.")
  params = checkpoint_lib.restore_params(init_from, spec.abstract["params"])
  fresh = jax.jit(
      lambda p: {"step": jnp.zeros((), jnp.int32), "params": p,
                 "model_state": spec.abstract["model_state"],
                 "opt_state": spec.tx.init(p)},
      out_shardings=spec.shardings, donate_argnums=0)
  state = fresh(params)
  if jax.process_index() == 0:
    print(f"initialised parameters from {init_from}", flush=True)
  return state


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises base.ConfigError naming the first bad training field.

  Every field against palimpsa_jax/run_config/base.py, then what depends on the
  devices: the mesh, and the batch's split over hosts, microbatches and shards.
  """
  base.validate(config)
  data, fsdp = sharding_lib.mesh_shape(config.mesh, jax.device_count())[:2]
  sharding_lib.validate_sequence_axis(config.mesh, config.seq_len)
  accum = grad_accum_steps(config, data * fsdp)
  if config.batch_size % (accum * jax.process_count()):
    raise base.ConfigError(
        f"config.batch_size={config.batch_size} must be a multiple of "
        f"grad_accum_steps * hosts = {accum * jax.process_count()}.")
  microbatch = config.batch_size // accum
  if microbatch % (data * fsdp):
    raise base.ConfigError(
        f"config.batch_size / grad_accum_steps = {microbatch} sequences must split evenly "
        f"over the mesh's data x fsdp = {data * fsdp} batch shards.")
  if config.eval_batch_size % (data * fsdp):
    raise base.ConfigError(
        f"config.eval_batch_size={config.eval_batch_size} must split evenly over the "
        f"mesh's data x fsdp = {data * fsdp} batch shards.")


def grad_accum_steps(config: ml_collections.ConfigDict, batch_shards: int) -> int:
  """config.grad_accum_steps; for None (auto), the fewest microbatches per step
  that put at most config.device_batch sequences on each of the batch_shards
  (data x fsdp) devices.

  Raises:
    base.ConfigError: auto without config.device_batch, or no count of
      microbatches divides config.batch_size that way.
  """
  if config.grad_accum_steps is not None:
    return config.grad_accum_steps
  limit = config.device_batch
  if limit is None:
    raise base.ConfigError(
        "config.grad_accum_steps=None (auto) needs config.device_batch, the most "
        "sequences per device and microbatch; it is None.")
  for count in range(1, config.batch_size + 1):
    per_device, rest = divmod(config.batch_size, count * batch_shards)
    if not rest and per_device <= limit:
      return count
  raise base.ConfigError(
      f"config.batch_size={config.batch_size} cannot be split into microbatches of at "
      f"most config.device_batch={limit} sequences on each of {batch_shards} batch "
      "shards; set config.grad_accum_steps explicitly.")


def evaluate(eval_step: Callable[..., jax.Array], state: dict, task: tasks_lib.Task,
             placement: sharding_lib.MeshContext,
             diagnostics_step: Callable[..., dict] | None = None
             ) -> dict[str, float]:
  """Mean loss and accuracy over the task's evaluation batches (one host sync).

  With `diagnostics_step`, also the mixers' per-layer diagnostics on the first
  evaluation batch.
  """
  total, diagnostics = None, {}
  for batch in task.eval_batches():
    batch = sharding_lib.global_batch(batch, placement.mesh, placement.rules)
    if diagnostics_step is not None and total is None:
      diagnostics = diagnostics_step(state["params"], state["model_state"], batch)
    sums = eval_step(state["params"], state["model_state"], batch)
    total = sums if total is None else total + sums
  if total is None:
    return {}
  total, diagnostics = jax.device_get((total, diagnostics))
  return bookkeeping.eval_metrics(total, diagnostics)


def validate_model(config: ml_collections.ConfigDict) -> None:
  """Raises base.ConfigError unless config.model builds and runs: the model is built and its
  objective traced on one abstract microbatch (shapes only: nothing is computed or allocated), so
  its fields, op implementation and dtypes are checked before a run touches its workdir.
  """
  data, fsdp = sharding_lib.mesh_shape(config.mesh, jax.device_count())[:2]
  rows = config.batch_size // (grad_accum_steps(config, data * fsdp) * data * fsdp)
  tokens = jax.ShapeDtypeStruct((rows, config.seq_len), jnp.int32)
  model_fn = state_lib.run_model_fn(config)
  objective = objective_lib.Objective.for_run(config)

  def minimised(tokens):
    with nnx.use_eager_sharding(False):
      model = model_fn(nnx.Rngs(config.seed))
    segment_ids = jnp.zeros_like(tokens) if config.task == "lm" else None
    return objective(model.token_losses(tokens, tokens, tokens >= 0, segment_ids=segment_ids))

  try:
    jax.eval_shape(minimised, tokens)
  except user_errors.UserError:
    raise
  except _MODEL_REFUSALS as error:
    text = " ".join(str(error).split()) or type(error).__name__
    raise base.ConfigError(f"config.model cannot be built and run: {text}") from error


class SingleRun:
  """loop.Engine of train.py's run: one train state, sharded over the mesh."""

  def __init__(self, config: ml_collections.ConfigDict, task: tasks_lib.Task,
               spec: state_lib.TrainStateSpec, placement: sharding_lib.MeshContext):
    self._config, self._task, self._spec, self._placement = config, task, spec, placement
    replicated = sharding_lib.replicated(placement.mesh)
    context = placement.kernel_context
    schedule = optimizer_lib.learning_rate_schedule(config.optimizer, task.total_steps)
    accum = grad_accum_steps(config, sharding_lib.batch_shards(placement.mesh))
    self._train_step = steps_lib.make_train_step(
        spec.parts.graphdef, spec.tx, schedule, objective_lib.Objective.for_run(config),
        spec.shardings, replicated, accum, context)
    self._eval_step = steps_lib.make_eval_step(spec.parts.graphdef, replicated, context)
    self._diagnostics_step = (
        steps_lib.make_diagnostics_step(spec.parts.graphdef, replicated, context)
        if config.log_diagnostics else None)
    self._compiled = None
    self.timing: compile_cache.CompileTiming | None = None
    self.num_params = sum(x.size for x in jax.tree.leaves(spec.abstract["params"]))
    self.tokens_per_step = task.tokens_per_step
    self.num_devices = jax.device_count()

  def abstract_state(self) -> dict:
    return self._spec.abstract

  def initial_state(self, runs: Sequence[bookkeeping.RunBook]) -> dict:
    del runs
    return initial_state(self._spec, self._config)

  def stack(self, states: Sequence[dict]) -> dict:
    (state,) = states
    return state

  def take(self, state: dict, rows: int | np.ndarray) -> dict:
    del rows  # the group's only run
    return state

  def step(self, state: dict, runs: Sequence[bookkeeping.RunBook], active: Sequence[bool]
           ) -> tuple[dict, dict[str, jax.Array]]:
    """The train step on the next batch, compiled ahead of time at the first (`timing`)."""
    del runs, active  # one run, active while the loop runs
    batch = sharding_lib.global_batch(next(self._task.train_iterator), self._placement.mesh,
                                      self._placement.rules)
    if self._compiled is None:
      self._compiled, self.timing = compile_cache.compile_timed(self._train_step, state, batch)
    return self._compiled(state, batch)

  def evaluate(self, state: dict, runs: Sequence[bookkeeping.RunBook]
               ) -> list[dict[str, float]]:
    del runs
    return [evaluate(self._eval_step, state, self._task, self._placement,
                     self._diagnostics_step)]


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       started_at: float | None = None,
                       should_stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
  """Trains the configured model, evaluating and checkpointing into `workdir`.

  Every refusal of `config` itself (validate_config, validate_model) comes before anything
  touches `workdir`. Holds `workdir`'s lock for the whole call (training/workdir_lock.py).
  A workdir that holds a run's config.json holds that run: it resumes from the latest
  checkpoint (the model, optimizer, step and data-iterator state are restored, so the
  continued run reproduces an uninterrupted one exactly) or, with none yet, starts it again
  at step 0, provided `config` changes only what a resume may change (run_config/resume.py).
  A new run starts at step 0 from config.init_from's parameters when that is set
  (fine-tuning a converted model, configs/finetune.py).

  The train step is compiled ahead of time on the first batch: its compile
  time (perf/compile_s, perf/lower_s) and the wall time from `started_at`
  (time.time() when the command started; default: this call) to the end of the
  first step (perf/time_to_first_step_s) are logged once, at the first step.

  `should_stop` is polled before every step (e.g. bookkeeping.StopSignals); when
  it returns True the current step is checkpointed and Interrupted is raised.

  Returns:
    The run summary over this and earlier segments of the run (also written
    to workdir/summary.json, see training/run_summary.py): best_accuracy,
    best_step, final_step, total_steps, stopped_early, wall_time_s, last_eval,
    num_params, segments; and, for this segment, compile_s,
    time_to_first_step_s and tokens_per_sec (every step after the first,
    evaluation and checkpointing included).

  Raises:
    bookkeeping.Interrupted: `should_stop` asked to stop; the step reached is saved.
    workdir_lock.WorkdirLocked: another live run holds `workdir`.
    base.ConfigError: a bad config, or a start that would change the saved run.
    NonFiniteError: the loss or gradient stopped being finite (the summary says so too).
    storage.StorageError: a write into `workdir` failed; the run stopped.
  """
  start_time = time.perf_counter()
  started_at = time.time() if started_at is None else started_at
  validate_config(config)
  validate_model(config)
  workdir = os.path.abspath(workdir)
  checkpoints = os.path.join(workdir, checkpoint_lib.CHECKPOINT_DIR)
  with (loop.failed_writes_in_one_line({workdir: checkpoints}),
        workdir_lock.WorkdirLock(workdir) as lock):
    given = config
    config, changes = bookkeeping.accept_resume(config, workdir)
    placement = sharding_lib.mesh_context(config.mesh)
    task = tasks_lib.make_task(config, workdir)
    spec = state_lib.make_train_state_spec(
        state_lib.run_model_fn(config), config.seed, make_tx_fn(config, task.total_steps),
        placement.mesh, placement.rules, init_on_host=config.init_on_host)
    engine = SingleRun(config, task, spec, placement)
    lock.accept()  # every refusal is behind: from here on the run writes its files
    run = bookkeeping.RunBook(config, workdir, changes, task.train_iterator)
    try:
      run.save_config(given)
      loop.train(engine, [run], task.total_steps, config, (start_time, started_at),
                 should_stop)
    except bookkeeping.Interrupted:
      if run.error is not None:  # stopped at a non-finite state: nothing was saved
        raise NonFiniteError(run.error) from None
      raise
    except BaseException:
      run.close(quiet=True)
      raise
  if run.error is not None:
    raise NonFiniteError(run.error)
  return run.summary
