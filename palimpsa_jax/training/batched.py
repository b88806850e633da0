"""Several MQAR runs of one model and setting, trained together in one process.

The runs of a group differ only in learning rate and seed. Their train states
are stacked along a leading run axis [R, ...] and one jitted step, the
single-run trainer's step (training/steps.py) vmapped over that axis, advances
all of them: per run its own parameters (initialised from its seed), optimizer
state, learning-rate schedule and data order (its seed's MQAR train and test
sets, data/tasks.py's MqarTask). The group trains in the training loop of
train.py (training/loop.py; GroupEngine is its engine): a run that reaches the
early-stop accuracy (or a non-finite loss) stops there, its updates are masked
out, and once a quarter of the stacked runs have stopped they are dropped from
the stack (one recompilation).

Each run keeps, in its own workdir, exactly the files of a single-run
train.py run: config.json, metrics.jsonl, tensorboard/, checkpoints/<step>
(Orbax, training/checkpoint.py) and, once it has ended, summary.json. A group
therefore resumes from its runs' checkpoints after any stop, and any of its
runs could also be continued alone by train.py.

Runs on one device (the first local one).
"""

from collections.abc import Callable, Sequence
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
from palimpsa_jax.training import checkpoint as checkpoint_lib
from palimpsa_jax.training import compile_cache
from palimpsa_jax.training import loop
from palimpsa_jax.training import objective as objective_lib
from palimpsa_jax.training import optimizer as optimizer_lib
from palimpsa_jax.training import run_summary
from palimpsa_jax.training import state as state_lib
from palimpsa_jax.training import steps as steps_lib
from palimpsa_jax.training import trainer
from palimpsa_jax.training import workdir_lock

# Fields in which the runs of a group may differ.
RUN_FIELDS = ("seed", "optimizer.learning_rate", "args.learning_rate", "args.seed")


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


def _label(config: ml_collections.ConfigDict) -> str:
  """The start of a run's lines: "lr 0.01 seed 0: "."""
  return f"lr {config.optimizer.learning_rate:g} seed {config.seed}: "


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


class GroupEngine:
  """loop.Engine of a group: its runs' states stacked [R, ...] on one device, one vmapped step."""

  def __init__(self, model: GroupModel, tasks: dict[int, tasks_lib.MqarTask],
               device: jax.Device):
    self._model, self._tasks, self._device = model, tasks, device
    self._abstract = model.abstract_one(device)
    self._compiled = {}  # by group size (the stack shrinks when runs end)
    self._rows_of, self._rows = None, None  # (learning rates [R], active [R]) of a stack
    self._eval_seeds, self._eval_batches = None, None
    self.timing: compile_cache.CompileTiming | None = None
    self.num_params = sum(x.size for x in jax.tree.leaves(self._abstract["params"]))
    self.tokens_per_step = next(iter(tasks.values())).tokens_per_step
    self.num_devices = 1

  def abstract_state(self) -> dict:
    return self._abstract

  def initial_state(self, runs: Sequence[bookkeeping.RunBook]) -> dict:
    return self._model.init([run.config.seed for run in runs], self._device)

  def stack(self, states: Sequence[dict]) -> dict:
    return _stack(list(states))

  def take(self, state: dict, rows: int | np.ndarray) -> dict:
    return _take(state, rows)

  def step(self, state: dict, runs: Sequence[bookkeeping.RunBook], active: Sequence[bool]
           ) -> tuple[dict, dict[str, jax.Array]]:
    """The vmapped step on every run's next batch; an inactive run's state is kept."""
    key = (tuple(map(id, runs)), tuple(active))
    if key != self._rows_of:
      self._rows_of = key
      self._rows = (jnp.asarray([r.config.optimizer.learning_rate for r in runs], jnp.float32),
                    jnp.asarray(active))
    batch = next_batch(self._tasks, [run.config.seed for run in runs])
    compiled = self._compiled.get(len(runs))
    if compiled is None:
      compiled, timing = compile_cache.compile_timed(self._model.train_step, state, batch,
                                                     *self._rows)
      self._compiled[len(runs)] = compiled
      self.timing = self.timing or timing
    return compiled(state, batch, *self._rows)

  def evaluate(self, state: dict, runs: Sequence[bookkeeping.RunBook]
               ) -> list[dict[str, float]]:
    seeds = [run.config.seed for run in runs]
    if seeds != self._eval_seeds:
      self._eval_seeds = seeds
      self._eval_batches = _stacked_eval_batches(self._tasks, seeds, self._device)
    return _evaluate(self._model, state, self._eval_batches)


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

  Raises:
    storage.StorageError: a write into a run's workdir failed; the group stopped.
  """
  start_time, started_at = time.perf_counter(), time.time()
  if len(configs) != len(workdirs):
    raise ValueError(f"got {len(configs)} configs but {len(workdirs)} workdirs.")
  for config in configs:
    trainer.validate_config(config)
  check_group(configs)
  trainer.validate_model(configs[0])  # the runs share their model
  workdirs = [os.path.abspath(workdir) for workdir in workdirs]
  summaries = [json.loads(_summary_path(w).read_text()) if _summary_path(w).exists()
               else None for w in workdirs]
  todo_indices = [i for i, summary in enumerate(summaries) if summary is None]
  if not todo_indices:
    return summaries
  checkpoints = {workdirs[i]: os.path.join(workdirs[i], checkpoint_lib.CHECKPOINT_DIR)
                 for i in todo_indices}
  todo: list[bookkeeping.RunBook] = []
  with loop.failed_writes_in_one_line(checkpoints), contextlib.ExitStack() as locks:
    held = [locks.enter_context(workdir_lock.WorkdirLock(workdirs[i]))  # as train.py's
            for i in todo_indices]
    accepted = [bookkeeping.accept_resume(configs[i], workdirs[i]) for i in todo_indices]
    config = accepted[0][0]
    tasks = {run_config.seed: tasks_lib.MqarTask(run_config) for run_config, _ in accepted}
    total_steps = next(iter(tasks.values())).total_steps
    engine = GroupEngine(GroupModel(config, total_steps), tasks, jax.local_devices()[0])
    for lock in held:
      lock.accept()
    try:
      for i, (run_config, changes) in zip(todo_indices, accepted):
        todo.append(bookkeeping.RunBook(run_config, workdirs[i], changes,
                                        tasks[run_config.seed].train_iterator,
                                        label=_label(run_config)))
        todo[-1].save_config(configs[i])
      loop.train(engine, todo, total_steps, config, (start_time, started_at), should_stop)
    except BaseException:
      for run in todo:
        run.close(quiet=True)
      raise
  for i, run in zip(todo_indices, todo):
    summaries[i] = run.summary
  return summaries
