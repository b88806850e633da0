"""train_and_evaluate: the training loop behind train.py (MQAR and language modelling)."""

from collections.abc import Callable
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax

from palimpsa_jax import models
from palimpsa_jax.data import tasks as tasks_lib
from palimpsa_jax.run_config import base
from palimpsa_jax.training import bookkeeping
from palimpsa_jax.training import cadence as cadence_lib
from palimpsa_jax.training import checkpoint as checkpoint_lib
from palimpsa_jax.training import compile_cache
from palimpsa_jax.training import metrics as metrics_lib
from palimpsa_jax.training import objective as objective_lib
from palimpsa_jax.training import optimizer as optimizer_lib
from palimpsa_jax.training import sharding as sharding_lib
from palimpsa_jax.training import state as state_lib
from palimpsa_jax.training import steps as steps_lib
from palimpsa_jax.training import workdir_lock


class NonFiniteError(FloatingPointError):
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


def _check_finite(finite: jax.Array, step: int, values: dict | None = None) -> None:
  if not bool(finite):
    detail = ""
    if values is not None:
      detail = (f" (last logged loss {values['train/loss']}, grad norm "
                f"{values['train/grad_norm']})")
    raise NonFiniteError(
        f"non-finite loss or gradient at or before step {step}{detail}; "
        "training stopped. Lower config.optimizer.learning_rate or check the data.")


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       started_at: float | None = None,
                       should_stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
  """Trains the configured model, evaluating and checkpointing into `workdir`.

  Holds `workdir`'s lock for the whole call (training/workdir_lock.py). Resumes
  from the latest checkpoint in `workdir` if there is one (the model, optimizer,
  step and data-iterator state are restored, so the continued run reproduces an
  uninterrupted one exactly), provided `config` changes only what a resume may
  change (run_config/resume.py). Without a checkpoint, the run
  starts at step 0 from config.init_from's parameters when that is set
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
    base.ConfigError: a bad config, or a resume that would change the saved run.
  """
  start_time = time.perf_counter()
  started_at = time.time() if started_at is None else started_at
  validate_config(config)
  workdir = os.path.abspath(workdir)
  with workdir_lock.WorkdirLock(workdir):
    given = config
    config, changes = bookkeeping.accept_resume(config, workdir)
    placement = sharding_lib.mesh_context(config.mesh)
    task = tasks_lib.make_task(config, workdir)
    spec = state_lib.make_train_state_spec(
        state_lib.run_model_fn(config), config.seed, make_tx_fn(config, task.total_steps),
        placement.mesh, placement.rules, init_on_host=config.init_on_host)
    book = bookkeeping.RunBook(config, workdir, changes)
    try:
      return _train(config, given, workdir, task, spec, placement, book, start_time,
                    started_at, should_stop)
    finally:
      book.close()


def _train(config: ml_collections.ConfigDict, given: ml_collections.ConfigDict, workdir: str,
           task: tasks_lib.Task, spec: state_lib.TrainStateSpec,
           placement: sharding_lib.MeshContext, book: bookkeeping.RunBook, start_time: float,
           started_at: float, should_stop: Callable[[], bool]) -> dict[str, Any]:
  """train_and_evaluate's loop, from the restore to the summary (`book` is closed by the caller).

  `config` is what runs (on resume, `given` with the saved schedule horizon); a run that
  starts afresh saves `given` as its config.json.
  """
  total_steps = task.total_steps
  start_step, state = book.restore(spec.abstract, task.train_iterator)
  book.save_config(given)  # once the run is accepted
  if start_step is None:  # a fine-tuning run resumes from its own checkpoints
    start_step = 0
    state = initial_state(spec, given)
  elif jax.process_index() == 0:
    print(bookkeeping.resumed_line(f"{workdir}/{checkpoint_lib.CHECKPOINT_DIR}/{start_step}",
                                   book.changes, config, total_steps), flush=True)

  replicated = sharding_lib.replicated(placement.mesh)
  kernel_context = placement.kernel_context
  schedule = optimizer_lib.learning_rate_schedule(config.optimizer, total_steps)
  accum = grad_accum_steps(config, sharding_lib.batch_shards(placement.mesh))
  train_step = steps_lib.make_train_step(
      spec.parts.graphdef, spec.tx, schedule, objective_lib.Objective.for_run(config),
      spec.shardings, replicated, accum, kernel_context)
  eval_step = steps_lib.make_eval_step(spec.parts.graphdef, replicated, kernel_context)
  diagnostics_step = (steps_lib.make_diagnostics_step(spec.parts.graphdef, replicated,
                                                      kernel_context)
                      if config.log_diagnostics else None)
  num_params = sum(x.size for x in jax.tree.leaves(spec.abstract["params"]))
  peak_flops = metrics_lib.peak_flops_per_device()
  finite = jnp.array(True)
  step = start_step
  compiled_step, startup, first_step_done = None, {}, None
  book.begin(start_step)

  def interrupt(at: int) -> str:  # the loop's state and finite flag as they are at the stop
    _check_finite(finite, at)
    book.save(at, state, task.train_iterator, time.perf_counter() - start_time)
    book.close()  # waits for the save
    return f"{workdir}/{checkpoint_lib.CHECKPOINT_DIR}/{at}"

  cadence = cadence_lib.Cadence(config, total_steps, start_step, started_at, should_stop,
                                interrupt, book.last_eval)
  progress = cadence.progress
  while step < total_steps and not book.stopped_early:
    overdue = cadence.before_step(step, book.time_due())
    batch = sharding_lib.global_batch(next(task.train_iterator), placement.mesh,
                                      placement.rules)
    if compiled_step is None:
      compiled_step, timing = compile_cache.compile_timed(train_step, state, batch)
    state, step_metrics = compiled_step(state, batch)
    finite = finite & step_metrics["train/finite"]
    step += 1
    due = cadence.after_step(step, overdue)
    record: dict[str, float] = {}
    if first_step_done is None:
      jax.block_until_ready(step_metrics)
      first_step_done = time.perf_counter()
      startup = metrics_lib.startup_metrics(timing, time.time() - started_at)
      record.update(startup)
      progress.show_startup(startup)
      progress.restart_clock(step)
    if due.log:
      values = jax.device_get(step_metrics)
      _check_finite(finite, step, values)
      rate = progress.rate(step)
      record.update({k: float(v) for k, v in values.items()
                     if k != "train/finite"})
      if rate is not None:  # None at the first step (its time is the compile's)
        record.update(metrics_lib.throughput_metrics(
            rate, task.tokens_per_step, num_params, peak_flops, jax.device_count()))
    if due.evaluate:
      _check_finite(finite, step)  # never score non-finite parameters
      results = evaluate(eval_step, state, task, placement, diagnostics_step)
      book.add_eval(step, results)
      record.update(results)
      cadence.evaluated(step, results)
    book.write(step, record)
    if due.log:
      progress.show(step, record.get("perf/steps_per_sec"), record["train/loss"],
                    tokens_per_sec=record.get("perf/tokens_per_sec"),
                    mfu=record.get("perf/mfu"))
    if due.save or book.stopped_early:
      _check_finite(finite, step)
      book.save(step, state, task.train_iterator, time.perf_counter() - start_time)
  book.close()  # the last checkpoint is written before the summary says the run ended

  end_time = time.perf_counter()
  after_first = (step - start_step - 1) * task.tokens_per_step
  summary = book.finish(
      {"total_steps": total_steps, "num_params": int(num_params),
       "compile_s": startup.get("perf/compile_s"),
       "time_to_first_step_s": startup.get("perf/time_to_first_step_s"),
       "tokens_per_sec": (after_first / (end_time - first_step_done)
                          if after_first > 0 else None)},
      step, end_time - start_time)
  if jax.process_index() == 0:
    best, reason = book.outcome_text(step, total_steps)
    print(f"final: best eval accuracy {best} ({reason}, "
          f"{summary['wall_time_s']:.0f} s){metrics_lib.summary_details(summary)}",
          flush=True)
  return summary
