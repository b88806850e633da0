"""The one training loop, behind train.py's run (training/trainer.py) and the MQAR sweep's
group of runs (training/batched.py): train.py's run is a group of one.

A group's runs advance together, one step of all of them at a time. What differs between one
sharded run and a stack of runs is an Engine's: its state, how it makes the next batch and
takes a step, how it evaluates and how one run's state is taken out of the group's. The rest
is here, once:

  restore      every run from its latest checkpoint (the same step for all), else the
               engine's initial state; a resumed run says where it resumed
  step loop    what training/cadence.py says is due after each step: log (metrics.jsonl,
               TensorBoard, the progress line), evaluate, checkpoint
  stop rules   a run that reaches config.early_stop_accuracy is checkpointed and ends; one whose
               loss or gradient stopped being finite ends with that error, its state neither
               evaluated nor saved; a stop request (Ctrl-C, SIGTERM) checkpoints every running
               run at the step reached and raises bookkeeping.Interrupted; a write into a
               workdir that fails (a full disk, a folder made read-only) stops the group with
               storage.StorageError
  summary      each run's summary.json and final line when it ends

Ended runs are masked in the step and, once they are a quarter of the group, dropped from it
(the engine then takes the rows of the runs left).
"""

from collections.abc import Callable, Iterator, Sequence
import contextlib
import os
import time
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from palimpsa_jax.training import bookkeeping
from palimpsa_jax.training import cadence as cadence_lib
from palimpsa_jax.training import checkpoint as checkpoint_lib
from palimpsa_jax.training import compile_cache
from palimpsa_jax.training import metrics as metrics_lib
from palimpsa_jax.training import storage

# Ended runs leave the group once they are at least this fraction of it.
_COMPACT_FRACTION = 0.25


class Engine(Protocol):
  """How a group's state is made and advanced (trainer.SingleRun, batched.GroupEngine).

  A group of one may keep its state as one run's (its metrics are then scalars); a larger
  group stacks its runs' states along a leading axis (its metrics are [R]).
  """

  num_params: int  # per run
  tokens_per_step: int  # per run
  num_devices: int  # the devices a run's step uses (for MFU)
  timing: compile_cache.CompileTiming | None  # the train step's compile, once it ran

  def abstract_state(self) -> Any:
    """One run's state as ShapeDtypeStructs with shardings (the restore target)."""

  def initial_state(self, runs: Sequence[bookkeeping.RunBook]) -> Any:
    """The group's step-0 state."""

  def stack(self, states: Sequence[Any]) -> Any:
    """The group's state from its runs' restored states."""

  def take(self, state: Any, rows: int | np.ndarray) -> Any:
    """Run `rows`' state (an int), or the group of runs `rows` (an index array)."""

  def step(self, state: Any, runs: Sequence[bookkeeping.RunBook], active: Sequence[bool]
           ) -> tuple[Any, dict[str, jax.Array]]:
    """One train step of every active run (on each run's next batch): (state, metrics)."""

  def evaluate(self, state: Any, runs: Sequence[bookkeeping.RunBook]
               ) -> list[dict[str, float]]:
    """Per run: eval/loss, eval/accuracy and diagnostics ({} without evaluation data)."""


def _row(values: dict[str, Any], index: int) -> dict[str, float]:
  """Run `index`'s logged values (scalars for a group of one)."""
  return {k: float(np.atleast_1d(v)[index]) for k, v in values.items() if k != "train/finite"}


def _non_finite(step: int, values: dict[str, float]) -> str:
  return (f"non-finite loss or gradient at or before step {step} (at step {step}: loss "
          f"{values.get('train/loss')}, grad norm {values.get('train/grad_norm')}); the run "
          "stopped without saving it. Lower config.optimizer.learning_rate or check the data")


@contextlib.contextmanager
def failed_writes_in_one_line(checkpoint_dirs: dict[str, str]) -> Iterator[None]:
  """Within (an entry point's whole run): a write into a workdir that fails raises the one-line
  storage.StorageError, and nothing else of the failure reaches the terminal.

  Args:
    checkpoint_dirs: {workdir: its checkpoint folder} of the runs.
  """
  with (storage.quiet_orbax_errors(), checkpoint_lib.tasks_finish_before_their_loop_closes(),
        storage.stop_on_failed_write(checkpoint_dirs)):
    yield


def train(engine: Engine, runs: Sequence[bookkeeping.RunBook], total_steps: int,
          config: ml_collections.ConfigDict, clock: tuple[float, float],
          should_stop: Callable[[], bool] = lambda: False) -> None:
  """Trains `runs` to their ends (see the module docstring); each run's summary is then
  run.summary, and run.error says why a run failed.

  Args:
    engine: the group's state and steps.
    runs: one RunBook per run (opened, not begun), in the engine's row order.
    total_steps: the runs' planned steps.
    config: the group's run config (its cadences and early stop).
    clock: (time.perf_counter(), time.time()) when the command started.
    should_stop: polled before every step (e.g. bookkeeping.StopSignals).

  Raises:
    bookkeeping.Interrupted: `should_stop` asked to stop; the running runs are saved.
    storage.StorageError: a write into a run's workdir failed; the group stopped.
    ValueError: the runs' latest checkpoints are at different steps.
  """
  group = _Group(engine, list(runs), total_steps, config, clock)
  with storage.stop_on_failed_write({r.workdir: r.checkpointer.directory for r in runs},
                                    lambda: group.step):
    try:
      group.run(should_stop)
    except storage.WriteFailed:
      for run in runs:
        run.close(quiet=True)  # waits for the saves still running, raises nothing more
      raise


class _Group:
  """The loop's state: the runs still in the group, their state, the step, the clocks."""

  def __init__(self, engine: Engine, runs: list[bookkeeping.RunBook], total_steps: int,
               config: ml_collections.ConfigDict, clock: tuple[float, float]):
    self.engine = engine
    self.stack = runs  # row i of the state is stack[i]'s; an ended run stays until compaction
    self.total_steps = total_steps
    self.config = config
    self.start_time, self.started_at = clock
    self.step: int | None = None  # None until restored
    self.start_step = 0
    self.state = None
    self.finite = None
    self.startup: dict[str, float] = {}
    self.first_step_done: float | None = None
    self.peak_flops = metrics_lib.peak_flops_per_device()

  def running(self) -> list[bookkeeping.RunBook]:
    return [r for r in self.stack if r.summary is None]

  def restore(self) -> None:
    """The state at the runs' latest checkpoint (the same step for all), or the initial one."""
    abstract = self.engine.abstract_state()
    restored = [run.restore(abstract) for run in self.stack]
    latest = {step for step, _ in restored}
    if len(latest) != 1:
      raise ValueError(
          "the runs of a group must resume from the same step; their latest "
          f"checkpoints are at {sorted(latest, key=str)} (None: none).")
    step = latest.pop()
    if step is None:
      self.start_step, self.state = 0, self.engine.initial_state(self.stack)
      for run in self.stack:
        if not run.new_run and jax.process_index() == 0:
          print(f"{run.label}no checkpoint in {run.checkpointer.directory} yet: the run of "
                f"{run.workdir}/{checkpoint_lib.CONFIG_FILE} starts again at step 0",
                flush=True)
    else:
      self.start_step, self.state = step, self.engine.stack([s for _, s in restored])
      if jax.process_index() == 0:
        for run in self.stack:
          where = f"{run.checkpointer.directory}/{step}"
          print(run.label + bookkeeping.resumed_line(where, run.changes, run.config,
                                                     self.total_steps), flush=True)
    self.step = self.start_step
    self.finite = jnp.ones((len(self.stack),), bool)

  def run(self, should_stop: Callable[[], bool]) -> None:
    self.restore()
    for run in self.stack:
      run.begin(self.start_step)
    for run in self.stack:  # resumed after their early stop, before their summary
      if run.stopped_early:
        self.finish(run)
    best = max((r.last_eval for r in self.stack),
               key=lambda e: e.get("eval/accuracy", -1.0), default=None)
    cadence = cadence_lib.Cadence(self.config, self.total_steps, self.start_step,
                                  self.started_at, should_stop, self.interrupt, best)
    while self.step < self.total_steps and self.running():
      running = self.running()
      overdue = cadence.before_step(self.step, any(r.time_due() for r in running))
      active = [r.summary is None for r in self.stack]
      self.state, step_metrics = self.engine.step(self.state, self.stack, active)
      self.finite = self.finite & step_metrics["train/finite"]
      self.step += 1
      for run in running:
        run.check_saves()
      records = {i: {} for i, a in enumerate(active) if a}
      if self.first_step_done is None:
        jax.block_until_ready(step_metrics)
        self.first_step_done = time.perf_counter()
        self.startup = metrics_lib.startup_metrics(self.engine.timing,
                                                   time.time() - self.started_at)
        for record in records.values():
          record.update(self.startup)
        cadence.progress.show_startup(self.startup)
        cadence.progress.restart_clock(self.step)
      self.after_step(cadence, cadence.after_step(self.step, overdue), step_metrics, records)
    for run in self.running():
      self.finish(run)

  def after_step(self, cadence: cadence_lib.Cadence, due: cadence_lib.Due,
                 step_metrics: dict[str, jax.Array], records: dict[int, dict[str, float]]
                 ) -> None:
    """What `due` asks for after self.step, for the runs that took it (records' keys)."""
    step, stack = self.step, self.stack
    if due.log or due.evaluate or due.save:
      values, finite = jax.device_get((step_metrics, self.finite))
      for i in records:
        if not np.atleast_1d(finite)[i]:
          stack[i].error = _non_finite(step, _row(values, i))
    if due.log:
      rate = cadence.progress.rate(step)
      for i, record in records.items():
        record.update(_row(values, i))
        if rate is not None:  # None at the first step (its time is the compile's)
          record.update(metrics_lib.throughput_metrics(
              rate, self.engine.tokens_per_step, self.engine.num_params, self.peak_flops,
              self.engine.num_devices))
    if due.evaluate:
      scored = [i for i in records if stack[i].error is None]
      if scored:
        results = self.engine.evaluate(self.state, stack)
        for i in scored:
          stack[i].add_eval(step, results[i])
          records[i].update(results[i])
        best = max(scored, key=lambda i: results[i].get("eval/accuracy", -1.0))
        cadence.evaluated(step, results[best])
        if len(stack) > 1 and jax.process_index() == 0:
          print(f"eval at step {step}: " + ", ".join(
              f"{stack[i].label}{100 * results[i]['eval/accuracy']:.2f}%"
              for i in scored if "eval/accuracy" in results[i]), flush=True)
    for i, record in records.items():
      stack[i].write(step, record)
    if due.log:
      self.show(cadence, step, [records[i] for i in records if stack[i].error is None])
    for i in records:
      run = stack[i]
      if run.error is None and (due.save or run.stopped_early):
        run.save(step, self.engine.take(self.state, i), self.wall_time())
      if run.error is not None or run.stopped_early:
        self.finish(run)
    self.compact()

  def show(self, cadence: cadence_lib.Cadence, step: int, records: list[dict[str, float]]
           ) -> None:
    """The progress line: the mean training loss of the runs, their summed throughput."""
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    if not losses:
      return
    total = lambda key: (sum(r[key] for r in records) if all(key in r for r in records)
                         else None)
    cadence.progress.show(step, records[0].get("perf/steps_per_sec"), float(np.mean(losses)),
                          tokens_per_sec=total("perf/tokens_per_sec"), mfu=total("perf/mfu"))

  def compact(self) -> None:
    """Drops the ended runs from the state once they are a quarter of the group."""
    ended = [i for i, r in enumerate(self.stack) if r.summary is not None]
    if not ended or not self.running() or len(ended) < _COMPACT_FRACTION * len(self.stack):
      return
    keep = np.asarray([i for i, r in enumerate(self.stack) if r.summary is None])
    self.state, self.finite = self.engine.take(self.state, keep), self.finite[keep]
    self.stack = [self.stack[i] for i in keep]
    if jax.process_index() == 0:
      print(f"{len(self.stack)} runs left in the stack", flush=True)

  def wall_time(self) -> float:
    return time.perf_counter() - self.start_time

  def interrupt(self, at: int) -> str:
    """Checkpoints the running runs at `at` (a run whose loss stopped being finite ends with
    that error instead), waits for the writes; says where they went."""
    finite = np.atleast_1d(jax.device_get(self.finite))
    saved = []
    for i, run in enumerate(self.stack):
      if run.summary is not None:
        continue
      if not finite[i]:
        run.error = _non_finite(at, {})
        self.finish(run)
        continue
      run.save(at, self.engine.take(self.state, i), self.wall_time())
      run.close()  # waits for the save
      saved.append(run)
    if len(self.stack) == 1:
      return f"{self.stack[0].checkpointer.directory}/{at}"
    return (f"{checkpoint_lib.CHECKPOINT_DIR}/{at} of the {len(saved)} running runs under "
            f"{os.path.dirname(self.stack[0].workdir)}")

  def finish(self, run: bookkeeping.RunBook) -> None:
    """Ends `run` at self.step: waits for its last checkpoint, then writes its summary and
    prints its final line."""
    run.close()  # the last checkpoint is written before the summary says the run ended
    end = time.perf_counter()
    after_first = (self.step - self.start_step - 1) * self.engine.tokens_per_step
    summary = run.finish(
        {"total_steps": self.total_steps, "num_params": int(self.engine.num_params),
         "compile_s": self.startup.get("perf/compile_s"),
         "time_to_first_step_s": self.startup.get("perf/time_to_first_step_s"),
         "tokens_per_sec": (after_first / (end - self.first_step_done)
                            if after_first > 0 else None)},
        self.step, end - self.start_time)
    if jax.process_index() == 0:
      best, reason = run.outcome_text(self.step, self.total_steps)
      print(f"{run.label}final: best eval accuracy {best} ({reason}, "
            f"{summary['wall_time_s']:.0f} s){metrics_lib.summary_details(summary)}",
            flush=True)
