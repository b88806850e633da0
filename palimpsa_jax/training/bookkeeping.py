"""Per-run bookkeeping of the training loop (training/loop.py), for train.py's run and each
run of the sweep's group (training/trainer.py, training/batched.py).

A RunBook keeps one run's workdir: its checkpointer (training/checkpoint.py), metric writer
(training/metrics.py) and summary (training/run_summary.py), its best evaluation and early
stop, and when to checkpoint. The entry points and the loop call its methods in this order:

  with workdir_lock.WorkdirLock(workdir) as lock:  # one live run per workdir
    config, changes = accept_resume(config, workdir)  # refusals, before anything is written
    lock.accept()
    book = RunBook(config, workdir, changes, data_iterator)  # opens the checkpointer
    book.save_config(config)                # a new run's config.json (a started run keeps its own)
    step, state = book.restore(abstract)
    book.begin(start_step)                  # writer, summary, earlier evaluations
    ... per step (when training/cadence.py says so): book.check_saves();
        book.add_eval(step, results); book.write(step, record);
        book.save(step, state, wall_time_s)
    book.close()                            # waits for the last asynchronous save
    book.finish(fields, step, wall_time_s)  # then summary.json says the run ended

Every write raises storage.WriteFailed naming its file when it fails (training/storage.py).

A run checkpoints every config.checkpoint_every_steps steps and, whatever that interval, at
the first step after config.checkpoint_every_minutes of wall time since its last save, so a
hard kill loses at most about that much work. StopSignals turns SIGINT and SIGTERM into a
request that the loops poll before each step: they checkpoint the step they are at and stop
with Interrupted, whose message says where a rerun of the same command resumes.

A workdir that holds a run's config.json holds that run, from its first step: a start there
continues it (run_config/resume.py), from its latest checkpoint or, killed before its first
one, again from step 0. accept_resume refuses settings that would change what it computes,
and the allowed changes (more steps, cadences) are recorded in the segment's record, while
config.json keeps describing the run as it was started.
"""

import json
import os
import signal
import sys
import threading
import time
from typing import Any

from flax import nnx
import jax
from jax.experimental import multihost_utils
import ml_collections
import numpy as np

from palimpsa_jax import models
from palimpsa_jax.run_config import base
from palimpsa_jax.run_config import resume
from palimpsa_jax.training import checkpoint as checkpoint_lib
from palimpsa_jax.training import metrics as metrics_lib
from palimpsa_jax.training import objective as objective_lib
from palimpsa_jax.training import run_summary
from palimpsa_jax.training import state as state_lib
from palimpsa_jax.training import storage


def eval_metrics(sums: np.ndarray, diagnostics: dict[str, float]) -> dict[str, float]:
  """eval/<name> for each of objective.METRICS (eval/loss, eval/accuracy: means over the
  scored tokens of `sums`, objective.metric_sums added over the batches) and the diagnostics."""
  means = objective_lib.means(np.asarray(sums, np.float64))
  return {**{f"eval/{name}": float(value) for name, value in means.items()},
          **{k: float(v) for k, v in diagnostics.items()}}


def _parameter_shapes(config: ml_collections.ConfigDict) -> dict[str, tuple[int, ...]]:
  """{parameter path: shape} of the run config's model, without allocating it."""
  parts = models.abstract_model(state_lib.run_model_fn(config))
  leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(parts.abstract_params))[0]
  return {jax.tree_util.keystr(path): tuple(leaf.shape) for path, leaf in leaves}


def _flat(tree: Any, prefix: str) -> dict[str, Any]:
  if not isinstance(tree, dict):
    return {prefix: tree}
  flat = {}
  for key, value in tree.items():
    flat.update(_flat(value, f"{prefix}.{key}"))
  return flat


def _holds_run(workdir: str) -> bool:
  """Whether `workdir` holds a run's config.json (written when the run was accepted)."""
  return os.path.isfile(os.path.join(workdir, checkpoint_lib.CONFIG_FILE))


def accept_resume(config: ml_collections.ConfigDict, workdir: str
                  ) -> tuple[ml_collections.ConfigDict, dict[str, tuple[Any, Any]]]:
  """(the config to run, {field: (saved, given)} of its allowed changes) for `workdir`.

  A new run (no config.json) runs `config` as given. A started run (with or without a
  checkpoint yet) runs it with the saved run's learning-rate horizon (resume.pinned), if it
  changes only fields a resume may change.

  Raises:
    base.ConfigError: one line naming each changed field of the run's identity with its
      saved and given values (or, for the same fields, another model's parameter shapes).
  """
  if not _holds_run(workdir):
    return config, {}
  saved = checkpoint_lib.load_config(workdir)
  refused, allowed = resume.differences(saved, config)
  if refused:
    raise base.ConfigError(resume.refusal(workdir, refused))
  refuse_other_model(config, workdir)
  return resume.pinned(config, saved), allowed


def resumed_line(where: str, changes: dict[str, tuple[Any, Any]],
                 config: ml_collections.ConfigDict, total_steps: int) -> str:
  """"resumed from <where>", with the settings changed since config.json and, when the run
  now goes past its learning-rate schedule, the rate of the steps beyond it."""
  line = f"resumed from {where}"
  if changes:
    line += "; changed since config.json: " + ", ".join(
        f"{path} {saved!r} -> {given!r}" for path, (saved, given) in changes.items())
  end = config.optimizer.decay_steps
  if end is not None and total_steps > end:
    rate = config.optimizer.learning_rate * config.optimizer.end_fraction
    line += (f" (the learning-rate schedule ends at step {end}; later steps train at its "
             f"final rate {rate:g})")
  return line


def refuse_other_model(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Refuses, before anything is written, a workdir whose checkpoints hold another model.

  Compares the parameter shapes of `config`'s model with those of the config saved in
  `workdir` (when it holds a run); a saved config that no longer builds is left to the
  restore to judge.

  Raises:
    base.ConfigError: one line naming the config.model fields that differ.
  """
  if not _holds_run(workdir):
    return
  saved = checkpoint_lib.load_config(workdir)
  try:
    saved_shapes = _parameter_shapes(saved)
  except Exception:  # pylint: disable=broad-exception-caught
    return  # e.g. a config of an older version of the code
  shapes = _parameter_shapes(config)
  if saved_shapes == shapes:
    return
  # Through JSON, as config.json holds it (tuples become lists).
  old, new = (_flat(json.loads(c.model.to_json_best_effort()), "config.model")
              for c in (saved, config))
  # Fields both configs have first: one missing on a side may be older or newer code's.
  keys = ([k for k in sorted(set(old) & set(new)) if old[k] != new[k]]
          or [k for k in sorted(set(old) ^ set(new))])
  fields = [f"{key}={new.get(key)!r} (saved: {old.get(key)!r})" for key in keys]
  if old.get("config.model.model") != new.get("config.model.model"):
    fields = [f for f in fields if f.startswith("config.model.model=")]  # the rest follows
  elif len(fields) > 6:
    fields = fields[:6] + [f"and {len(fields) - 6} more"]
  if not fields:  # same fields, other code: name the first parameter that differs
    path = next(p for p in sorted(set(saved_shapes) | set(shapes))
                if saved_shapes.get(p) != shapes.get(p))
    fields = [f"parameter {path} {shapes.get(path)} (saved: {saved_shapes.get(path)})"]
  raise base.ConfigError(
      f"--workdir {workdir} holds a run of another model: {', '.join(fields)}. "
      "Give a new --workdir, or the saved run's config (its config.json) to resume it.")


def agreed(step: int, every: int, *flags: bool) -> tuple[bool, ...]:
  """The flags as every process will act on them.

  One process: as given. Several (whose clocks and signals differ): at steps that are
  multiples of `every`, each flag is raised if it is raised on any process, and False at
  other steps, so that all processes take a collective checkpoint at the same step.
  """
  if jax.process_count() == 1:
    return flags
  if step % every:
    return (False,) * len(flags)
  raised = multihost_utils.process_allgather(np.asarray(flags, bool))
  return tuple(bool(x) for x in np.asarray(raised).reshape(-1, len(flags)).any(axis=0))


class Interrupted(Exception):
  """A stop request ended training; the runs were checkpointed at `step`."""

  def __init__(self, step: int, where: str):
    super().__init__(f"interrupted at step {step}; checkpoint saved in {where}; "
                     "rerun the same command to resume")
    self.step = step


class StopSignals:
  """SIGINT and SIGTERM as a stop request that a training loop polls (`stop()` -> bool).

  Use as a context manager; the previous handlers come back on exit. The first signal only
  sets the request, so the loop can checkpoint; a second SIGINT quits at once
  (KeyboardInterrupt), keeping only the checkpoints already saved. Outside the main
  thread, where Python cannot install handlers, nothing is installed and no request comes.
  """

  SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __init__(self):
    self.signum: int | None = None
    self._previous: dict[int, Any] = {}

  def __enter__(self) -> "StopSignals":
    if threading.current_thread() is threading.main_thread():
      self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
    return self

  def __exit__(self, *exc_info) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}

  def _handle(self, signum, frame) -> None:
    del frame
    if self.signum is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.signum = signum
    print(f"{signal.Signals(signum).name}: checkpointing the current step, then stopping "
          "(Ctrl-C again quits without saving)", file=sys.stderr, flush=True)

  def __call__(self) -> bool:
    return self.signum is not None

  @property
  def exit_code(self) -> int:
    """The shell's code for a process ended by the signal: 128 + its number."""
    return 128 + (self.signum or signal.SIGINT)


class RunBook:
  """One run's checkpoints, metrics, summary, best evaluation and early stop (see above)."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str,
               changes: dict[str, tuple[Any, Any]] | None = None, data_iterator: Any = None,
               label: str = ""):
    """
    Args:
      config: the run config (accept_resume's).
      workdir: the run's absolute workdir.
      changes: accept_resume's allowed changes, recorded in the segment.
      data_iterator: the run's checkpointable training-data iterator (saved and restored
        with its state).
      label: "lr 0.01 seed 0: ", the start of the run's lines when it trains in a group.
    """
    self.config = config
    self.workdir = workdir
    self.changes = changes or {}
    self.data_iterator = data_iterator
    self.label = label
    self.new_run = False  # whether save_config started it (it had no config.json)
    self.checkpointer = checkpoint_lib.Checkpointer(
        workdir, every_steps=config.checkpoint_every_steps, keep=config.keep_checkpoints,
        async_save=config.async_checkpointing)
    self.writer: metrics_lib.MetricWriter | None = None
    self.summary_file: run_summary.RunSummary | None = None
    self.best: float | None = None
    self.best_step: int | None = None
    self.last_eval: dict[str, float] = {}
    self.stopped_early = False
    self.error: str | None = None  # why the run stopped, if it failed
    self.summary: dict[str, Any] | None = None  # once finished
    self.saved_step: int | None = None  # of its latest checkpoint
    self._saved_at = time.monotonic()
    self._closed = False

  def restore(self, abstract_state: dict) -> tuple[int | None, dict | None]:
    """(step, state) of the latest checkpoint, or (None, None); see Checkpointer. The data
    iterator is restored in place."""
    step, state = self.checkpointer.restore_latest(abstract_state, self.data_iterator)
    self.saved_step = step
    return step, state

  def save_config(self, config: ml_collections.ConfigDict) -> None:
    """Writes config.json for a new run; a started run keeps the config.json it was started
    with (accept_resume compared `config` with it)."""
    if not _holds_run(self.workdir):
      checkpoint_lib.save_config(config, self.workdir)
      self.new_run = True

  def begin(self, start_step: int) -> None:
    """Opens the metric writer and summary at `start_step` and reads the earlier evaluations.

    A resumed run that had already reached the early-stop accuracy is stopped_early.
    """
    self._saved_at = time.monotonic()
    self.writer = metrics_lib.MetricWriter(self.workdir, start_step)
    self.summary_file = run_summary.RunSummary(self.workdir, start_step, self.changes)
    self.best, self.best_step, self.last_eval = run_summary.previous_evals(
        self.workdir, start_step)
    self.stopped_early = self.best is not None and self._reaches_early_stop(self.best)

  def _reaches_early_stop(self, accuracy: float) -> bool:
    early_stop = self.config.early_stop_accuracy
    return early_stop is not None and early_stop <= accuracy

  def add_eval(self, step: int, results: dict[str, float]) -> None:
    """Records an evaluation: the latest, the best accuracy so far, the early stop."""
    self.last_eval = results
    accuracy = results.get("eval/accuracy")
    if accuracy is None:
      return
    if self.best is None or accuracy > self.best:
      self.best, self.best_step = accuracy, step
    self.stopped_early = self._reaches_early_stop(accuracy)

  def write(self, step: int, record: dict[str, Any]) -> None:
    if record:
      self.writer.write(step, record)

  def time_due(self) -> bool:
    """Whether config.checkpoint_every_minutes have passed since the last save."""
    minutes = self.config.checkpoint_every_minutes
    return bool(minutes) and time.monotonic() - self._saved_at >= 60 * minutes

  def check_saves(self) -> None:
    """Raises storage.WriteFailed if a checkpoint written in the background failed."""
    self.checkpointer.check()

  def save(self, step: int, state: dict, wall_time_s: float) -> None:
    """Checkpoints `step` (once) and records the segment's progress in the summary."""
    if step == self.saved_step:
      return
    self.checkpointer.save(step, state, self.data_iterator, force=True)
    self.summary_file.progress(step, wall_time_s)
    self.saved_step = step
    self._saved_at = time.monotonic()

  def finish(self, fields: dict[str, Any], step: int, wall_time_s: float) -> dict[str, Any]:
    """Writes summary.json: the run's outcome (best, early stop, error) and `fields`."""
    outcome = {"best_accuracy": self.best, "best_step": self.best_step,
               "stopped_early": self.stopped_early, "last_eval": self.last_eval}
    if self.error is not None:
      outcome["error"] = self.error
    self.summary = self.summary_file.write({**outcome, **fields}, final_step=step,
                                           wall_time_s=wall_time_s)
    return self.summary

  def outcome_text(self, step: int, total_steps: int) -> tuple[str, str]:
    """("99.17% at step 1248" or "n/a", why it ended) for the final line."""
    best = ("n/a" if self.best is None
            else f"{100 * self.best:.2f}% at step {self.best_step}")
    reason = self.error or (
        f"early stop at accuracy >= {self.config.early_stop_accuracy}" if self.stopped_early
        else f"{step}/{total_steps} steps")
    return best, reason

  def close(self, quiet: bool = False) -> None:
    """Waits for the last checkpoint to be written; closes the checkpointer and writer.

    Args:
      quiet: the run is stopping on another error (which the caller raises): a write that
        fails here is not raised.
    """
    if self._closed:
      return
    self._closed = True
    try:
      try:
        self.checkpointer.close()
      finally:
        if self.writer is not None:
          self.writer.close()
    except storage.WriteFailed:
      if not quiet:
        raise
