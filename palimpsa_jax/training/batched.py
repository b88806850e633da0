"""Several MQAR runs of one model and setting, trained together in one process.

The runs of a group differ only in learning rate and seed. Their train states
are stacked along a leading run axis [R, ...] and one jitted step, the
single-run trainer's step (training/steps.py) vmapped over that axis, advances
all of them: per run its own parameters (initialised from its seed), optimizer
state, learning-rate schedule and data order (its seed's MQAR train and test
sets, data/tasks.py's MqarTask). A run that reaches the early-stop
accuracy (or a non-finite loss) stops there: its updates are masked out, and
once a quarter of the stacked runs have stopped they are dropped from the stack
(one recompilation).

Each run keeps, in its own workdir, exactly the files of a single-run
train.py run: config.json, metrics.jsonl, tensorboard/, checkpoints/<step>
(Orbax, training/checkpoint.py) and, once it has ended, summary.json. A group
therefore resumes from its runs' checkpoints after any stop, and any of its
runs could also be continued alone by train.py.

Runs on one device (the first local one).
"""

from collections.abc import Callable
import contextlib
import functools
import json
import os
import pathlib
import time
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from palimpsa_jax import models
from palimpsa_jax.data import tasks as tasks_lib
from palimpsa_jax.training import bookkeeping
from palimpsa_jax.training import cadence as cadence_lib
from palimpsa_jax.training import metrics as metrics_lib
from palimpsa_jax.training import objective as objective_lib
from palimpsa_jax.training import optimizer as optimizer_lib
from palimpsa_jax.training import run_summary
from palimpsa_jax.training import state as state_lib
from palimpsa_jax.training import steps as steps_lib
from palimpsa_jax.training import trainer
from palimpsa_jax.training import workdir_lock

# Fields in which the runs of a group may differ.
RUN_FIELDS = ("seed", "optimizer.learning_rate", "args.learning_rate", "args.seed")
# Stopped runs leave the stack once they are at least this fraction of it.
_COMPACT_FRACTION = 0.25


def _flat(config: ml_collections.ConfigDict) -> dict[str, Any]:
  flat = {}
  def walk(prefix, value):
    if isinstance(value, dict):
      for key, item in value.items():
        walk(f"{prefix}{key}.", item)
    else:
      flat[prefix[:-1]] = value
  walk("", config.to_dict())
  return flat


def check_group(configs: list[ml_collections.ConfigDict]) -> None:
  """Raises ValueError unless the configs can train as one group.

  They must be MQAR configs from scratch, equal in everything but RUN_FIELDS,
  with distinct (learning rate, seed) pairs.
  """
  if not configs:
    raise ValueError("train_group needs at least one config.")
  first = _flat(configs[0])
  for index, config in enumerate(configs):
    if config.task != "mqar":
      raise ValueError(f"configs[{index}].task must be 'mqar', got {config.task!r}.")
    if config.init_from or config.optimizer.new_params_only_steps:
      raise ValueError(f"configs[{index}]: batched runs start from scratch "
                       "(no init_from, no new_params_only_steps).")
    flat = _flat(config)
    for key in sorted(set(first) | set(flat)):
      if key not in RUN_FIELDS and first.get(key) != flat.get(key):
        raise ValueError(
            f"configs[{index}].{key}={flat.get(key)!r} differs from configs[0]'s "
            f"{first.get(key)!r}; a group's runs may differ only in {RUN_FIELDS}.")
  pairs = [(c.optimizer.learning_rate, c.seed) for c in configs]
  if len(set(pairs)) != len(pairs):
    raise ValueError(f"a group's (learning rate, seed) pairs must differ, got {pairs}.")


def _label(run: bookkeeping.RunBook) -> str:
  return f"lr {run.config.optimizer.learning_rate:g} seed {run.config.seed}"


def _stack(trees: list[Any]) -> Any:
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _take(tree: Any, index) -> Any:
  return jax.tree.map(lambda x: x[index], tree)


class GroupModel:
  """The group's model, optimizer and vmapped steps (shapes: leading run axis R)."""

  def __init__(self, config: ml_collections.ConfigDict, total_steps: int):
    self.config = config
    self.total_steps = total_steps
    self.model_fn = state_lib.run_model_fn(config)
    self.graphdef = models.abstract_model(self.model_fn).graphdef
    # The schedule of learning rate 1; a run's rate scales it (the product
    # is the single-run schedule's peak * factor, bit for bit).
    unit = ml_collections.ConfigDict(config.optimizer.to_dict())
    unit.learning_rate = 1.0
    self._unit_schedule = optimizer_lib.learning_rate_schedule(unit, total_steps)
    accum = trainer.grad_accum_steps(config, 1)
    objective = objective_lib.Objective.for_run(config)

    def one_step(state, batch, lr, active):
      tx, schedule = self._optimizer(lr)
      new, metrics = steps_lib.train_step_fn(self.graphdef, tx, schedule, objective, accum)(
          state, batch)
      return jax.tree.map(lambda n, o: jnp.where(active, n, o), new, state), metrics

    # (state [R], batch [R, B, ...], lr [R], active [R] bool) -> (state, metrics [R])
    self.train_step = jax.jit(jax.vmap(one_step), donate_argnums=0)
    self.eval_step = jax.jit(jax.vmap(functools.partial(steps_lib.eval_sums,
                                                        self.graphdef)))
    self.diagnostics_step = jax.jit(jax.vmap(functools.partial(
        steps_lib.diagnostics, self.graphdef)))

  def _optimizer(self, lr):
    schedule = lambda count: lr * self._unit_schedule(count)
    tx = optimizer_lib.make_optimizer(self.config.optimizer, self.total_steps,
                                      models.weight_decay_mask, schedule)
    return tx, schedule

  def _init_one(self, key: jax.Array) -> dict:
    with nnx.use_eager_sharding(False):
      _, params, model_state = models.split_model(self.model_fn(nnx.Rngs(key)))
    tx, _ = self._optimizer(1.0)  # the optimizer state does not depend on the rate
    return {"step": jnp.zeros((), jnp.int32), "params": params,
            "model_state": model_state, "opt_state": tx.init(params)}

  def init(self, seeds: list[int], device: jax.Device) -> dict:
    """Fresh stacked state: run i's parameters are those train.py draws for seeds[i].

    Like the single-run trainer, computed on the CPU when config.init_on_host
    resolves to True (off the CPU backend), then copied to `device`.
    """
    on_host = state_lib.resolve_init_on_host(self.config.init_on_host)
    where = jax.local_devices(backend="cpu")[0] if on_host else device
    init = jax.jit(jax.vmap(lambda seed: self._init_one(jax.random.key(seed))),
                   out_shardings=jax.sharding.SingleDeviceSharding(where))
    # A host array: the computation runs where out_shardings puts it.
    return jax.device_put(init(np.asarray(seeds, np.int32)), device)

  def abstract_one(self, device: jax.Device) -> dict:
    """ShapeDtypeStructs of one run's state on `device` (the restore target)."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    shapes = jax.eval_shape(self._init_one, jax.random.key(0))
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), shapes)


def next_batch(tasks: dict[int, tasks_lib.MqarTask], seeds: list[int]
               ) -> dict[str, np.ndarray]:
  """The group's next training batch {name: [R, B, ...]}: run i's from seeds[i]'s task
  (runs sharing a seed share its batch)."""
  batches = {seed: next(tasks[seed].train_iterator) for seed in dict.fromkeys(seeds)}
  return {key: np.stack([batches[s][key] for s in seeds]) for key in batches[seeds[0]]}


def _summary_path(workdir: str) -> pathlib.Path:
  return pathlib.Path(workdir) / run_summary.SUMMARY_FILE


def _stacked_eval_batches(tasks: dict[int, tasks_lib.MqarTask], seeds: list[int],
                          device: jax.Device) -> list[dict[str, jax.Array]]:
  """The test batches of every run, stacked [R, B, ...] on `device`."""
  per_seed = {seed: list(task.eval_batches()) for seed, task in tasks.items()}
  counts = {len(batches) for batches in per_seed.values()}
  if len(counts) != 1:
    raise ValueError(f"the runs' test sets have different batch counts {counts}.")
  return [jax.device_put({key: np.stack([per_seed[s][i][key] for s in seeds])
                          for key in per_seed[seeds[0]][i]}, device)
          for i in range(counts.pop())]


def _evaluate(model: GroupModel, state: dict, eval_batches: list[dict]
              ) -> list[dict[str, float]]:
  """Per run: eval/loss, eval/accuracy (and diagnostics), as trainer.evaluate."""
  total, diagnostics = None, {}
  for batch in eval_batches:
    if model.config.log_diagnostics and total is None:
      diagnostics = model.diagnostics_step(state["params"], state["model_state"], batch)
    sums = model.eval_step(state["params"], state["model_state"], batch)
    total = sums if total is None else total + sums
  total, diagnostics = jax.device_get((total, diagnostics))
  return [bookkeeping.eval_metrics(sums, {k: v[i] for k, v in diagnostics.items()})
          for i, sums in enumerate(total)]


def _finish(run: bookkeeping.RunBook, step: int, total_steps: int, num_params: int,
            wall_time_s: float) -> None:
  """Writes the run's summary.json (the single-run trainer's fields, summed over the
  run's segments: training/run_summary.py) and prints it."""
  run.close()  # the last checkpoint is written before the summary says the run ended
  run.finish({"total_steps": total_steps, "num_params": int(num_params)}, step,
             wall_time_s)
  best, reason = run.outcome_text(step, total_steps)
  print(f"{_label(run)}: final: best eval accuracy {best} ({reason})", flush=True)


def train_group(configs: list[ml_collections.ConfigDict], workdirs: list[str],
                should_stop: Callable[[], bool] = lambda: False
                ) -> list[dict[str, Any]]:
  """Trains the runs `configs[i]` into `workdirs[i]` together (see module docstring).

  Runs whose workdir holds summary.json are done and skipped. The others
  resume from their latest checkpoint, which must be the same step for all
  of them (none: step 0).

  Args:
    configs: MQAR configs (configs/mqar.py) that differ only in RUN_FIELDS.
    workdirs: one directory per config.
    should_stop: polled before every step (e.g. bookkeeping.StopSignals); when
      it returns True, every running run is checkpointed at the current step
      and bookkeeping.Interrupted is raised.

  Returns:
    Per run its summary (as trainer.train_and_evaluate returns it).
  """
  start_time, started_at = time.perf_counter(), time.time()
  if len(configs) != len(workdirs):
    raise ValueError(f"got {len(configs)} configs but {len(workdirs)} workdirs.")
  for config in configs:
    trainer.validate_config(config)
  check_group(configs)
  workdirs = [os.path.abspath(workdir) for workdir in workdirs]
  summaries = [json.loads(_summary_path(w).read_text()) if _summary_path(w).exists()
               else None for w in workdirs]
  todo_indices = [i for i, summary in enumerate(summaries) if summary is None]
  if not todo_indices:
    return summaries
  with contextlib.ExitStack() as locks:
    for i in todo_indices:  # one live run per workdir, as train.py's
      locks.enter_context(workdir_lock.WorkdirLock(workdirs[i]))
    accepted = [bookkeeping.accept_resume(configs[i], workdirs[i]) for i in todo_indices]
    config = accepted[0][0]
    device = jax.local_devices()[0]
    tasks = {run_config.seed: tasks_lib.MqarTask(run_config) for run_config, _ in accepted}
    total_steps = next(iter(tasks.values())).total_steps
    model = GroupModel(config, total_steps)
    todo: list[bookkeeping.RunBook] = []
    try:
      for i, (run_config, changes) in zip(todo_indices, accepted):
        todo.append(bookkeeping.RunBook(run_config, workdirs[i], changes))
      _train(model, tasks, todo, [configs[i] for i in todo_indices], device,
             (start_time, started_at), should_stop)
    finally:
      for run in todo:
        run.close()
  for i, run in zip(todo_indices, todo):
    summaries[i] = run.summary
  return summaries


def _train(model: GroupModel, tasks: dict[int, tasks_lib.MqarTask],
           todo: list[bookkeeping.RunBook], given: list[ml_collections.ConfigDict],
           device: jax.Device, start: tuple[float, float],
           should_stop: Callable[[], bool]) -> None:
  """train_group's loop, from the restore to every run's summary (runs closed by the caller).

  given[i]: todo[i]'s config as given, saved as config.json by a run that starts afresh.
  start: (time.perf_counter(), time.time()) when train_group was called.
  """
  start_time, started_at = start
  config, total_steps = model.config, model.total_steps
  abstract = model.abstract_one(device)
  restored = [run.restore(abstract, tasks[run.config.seed].train_iterator) for run in todo]
  for run, run_config in zip(todo, given):
    run.save_config(run_config)
  latest = {step for step, _ in restored}
  if len(latest) != 1:
    raise ValueError(
        "the runs of a group must resume from the same step; their latest "
        f"checkpoints are at {sorted(latest, key=str)} (None: none).")
  start_step = latest.pop()
  if start_step is None:
    start_step = 0
    state = model.init([run.config.seed for run in todo], device)
  else:
    state = _stack([run_state for _, run_state in restored])
    print(f"resumed {len(todo)} runs from step {start_step}", flush=True)
  num_params = sum(x.size for x in jax.tree.leaves(abstract["params"]))
  peak_flops = metrics_lib.peak_flops_per_device()
  tokens_per_step = next(iter(tasks.values())).tokens_per_step
  for run in todo:
    run.begin(start_step)

  # The stack: stack[i] is row i of `state`; a stopped run stays until compaction.
  stack = list(todo)
  running = lambda: [r for r in stack if r.summary is None and not r.stopped_early]
  for run in stack:  # resumed after their early stop, before their summary
    if run.stopped_early:
      _finish(run, start_step, total_steps, num_params, 0.0)
  eval_batches = None
  finite = jnp.ones((len(stack),), bool)
  step = start_step
  rows = None  # per stacked run: (learning rates [R], running [R])

  def interrupt(at: int) -> str:  # the stack and its state as they are at the stop
    for i, run in enumerate(stack):
      if run.summary is None:
        run.save(at, _take(state, i), tasks[run.config.seed].train_iterator,
                 time.perf_counter() - start_time)
        run.close()  # waits for the save
    return (f"checkpoints/{at} of the {len(running())} running runs under "
            f"{os.path.dirname(stack[0].workdir)}")

  accuracies = [r.last_eval["eval/accuracy"] for r in stack if "eval/accuracy" in r.last_eval]
  cadence = cadence_lib.Cadence(  # the line shows the best run's last accuracy
      config, total_steps, start_step, started_at, should_stop, interrupt,
      {"eval/accuracy": max(accuracies)} if accuracies else None)
  while step < total_steps and running():
    overdue = cadence.before_step(step, any(r.time_due() for r in running()))
    if rows is None:  # the stack or its running runs changed
      active = [r.summary is None for r in stack]
      seeds = [r.config.seed for r in stack]
      rows = (jnp.asarray([r.config.optimizer.learning_rate for r in stack],
                          jnp.float32), jnp.asarray(active))
    state, step_metrics = model.train_step(state, next_batch(tasks, seeds), *rows)
    finite = finite & step_metrics["train/finite"]
    step += 1
    due = cadence.after_step(step, overdue)
    if not (due.log or due.evaluate or due.save):
      continue
    values, finite_now = jax.device_get((step_metrics, finite))
    records: dict[int, dict[str, float]] = {i: {} for i, a in enumerate(active) if a}
    for i in records:
      if not finite_now[i]:
        stack[i].error = (f"non-finite loss or gradient at or before step {step}; "
                          "run stopped")
    if due.log:
      rate = cadence.progress.rate(step)
      for i in records:
        records[i].update({k: float(v[i]) for k, v in values.items()
                           if k != "train/finite"})
        records[i].update(metrics_lib.throughput_metrics(
            rate, tokens_per_step, num_params, peak_flops, 1))
    if due.evaluate:
      if eval_batches is None:
        eval_batches = _stacked_eval_batches(tasks, seeds, device)
      results = _evaluate(model, state, eval_batches)
      for i in records:
        if stack[i].error is None:
          stack[i].add_eval(step, results[i])
          records[i].update(results[i])
      cadence.evaluated(step, {"eval/accuracy": max(
          stack[i].last_eval.get("eval/accuracy", 0.0) for i in records)})
      print(f"eval at step {step}: " + ", ".join(
          f"{_label(stack[i])} {100 * stack[i].last_eval['eval/accuracy']:.2f}%"
          for i in records if stack[i].last_eval), flush=True)
    for i, record in records.items():
      run = stack[i]
      run.write(step, record)
      if run.error is None and (due.save or run.stopped_early):
        run.save(step, _take(state, i), tasks[run.config.seed].train_iterator,
                 time.perf_counter() - start_time)
      if run.error is not None or run.stopped_early:
        _finish(run, step, total_steps, num_params, time.perf_counter() - start_time)
        rows = None
    if due.log:
      losses = [records[i]["train/loss"] for i in records if stack[i].summary is None]
      if losses:
        cadence.progress.show(step, rate, float(np.mean(losses)))
    stopped = [i for i, r in enumerate(stack) if r.summary is not None]
    if stopped and running() and len(stopped) >= _COMPACT_FRACTION * len(stack):
      keep = [i for i, r in enumerate(stack) if r.summary is None]
      state, finite = _take(state, np.asarray(keep)), finite[np.asarray(keep)]
      stack = [stack[i] for i in keep]
      rows = None
      eval_batches = None
      print(f"{len(stack)} runs left in the stack", flush=True)
  for run in stack:
    if run.summary is None:
      _finish(run, step, total_steps, num_params, time.perf_counter() - start_time)
