"""Orbax checkpoints of a training run, and loading a trained model back.

A workdir written by train.py holds:
  config.json            the run's configuration (to rebuild the model)
  checkpoints/<step>/    Orbax items: "model" {params, model_state},
                         "optimizer" {step, opt_state}, "data" (grain
                         iterator state, one JSON file per host)
  corrupt_checkpoints/<step>-<UTC time>/
                         checkpoints that could not be restored, moved
                         aside when an older one restored instead
  metrics.jsonl          see training/metrics.py

A parameters-only checkpoint (a conversion output, which a fine-tuning run
starts from: config.init_from) holds converted/, an Orbax StandardCheckpointer
item {"params": parameter tree}; see save_params and restore_params.
"""

import asyncio
import contextlib
import datetime
import os
import shutil
from typing import Any
import warnings

import grain
import jax
import ml_collections
import orbax.checkpoint as ocp
from etils import epath

from palimpsa_jax import models
from palimpsa_jax import user_errors
from palimpsa_jax.run_config import base
from palimpsa_jax.training import state as state_lib
from palimpsa_jax.training import storage

CONFIG_FILE = "config.json"
CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "corrupt_checkpoints"
PARAMS_DIR = "converted"


class CheckpointError(RuntimeError, user_errors.UserError):
  """A checkpoint exists but cannot be read (truncated or missing files)."""


def _first_line(error: BaseException) -> str:
  """"Type: first line" of the innermost cause of `error` (what failed, and where)."""
  while error.__cause__ is not None or error.__context__ is not None:
    error = error.__cause__ or error.__context__
  lines = str(error).strip().splitlines()
  text = lines[0] if lines else ""
  return f"{type(error).__name__}: {text[:300]}"


class _LoopThatFinishesItsTasks(asyncio.SelectorEventLoop):
  """An event loop whose close() first runs its unfinished tasks to their end.

  Orbax runs each restore, and each item of a save, in a fresh loop that it
  closes as soon as its coroutine returns or raises. When one array read or
  write fails (a truncated file, a full disk), the asyncio.gather above it
  raises at once and the sibling reads or writes keep running as tasks of that
  loop; closing the loop under them makes each one fail later, in whatever
  code runs then: TensorStore's completion cannot be delivered ("Event loop is
  closed", a traceback each), and the garbage collector's closing of the
  abandoned coroutine raises. Both are unraisable exceptions (a
  PytestUnraisableExceptionWarning in another test). Waiting for them costs at
  most the time the whole restore or save would have taken.
  """

  def close(self) -> None:
    # A finishing read may start others (a gather of its own that fails): until none is left.
    while not self.is_running() and not self.is_closed() and (
        unfinished := asyncio.all_tasks(self)):
      # return_exceptions: their errors repeat the one the restore raised.
      self.run_until_complete(asyncio.gather(*unfinished, return_exceptions=True))
    super().close()


class _LoopPolicy(asyncio.DefaultEventLoopPolicy):

  def new_event_loop(self) -> asyncio.AbstractEventLoop:
    return _LoopThatFinishesItsTasks()


@contextlib.contextmanager
def tasks_finish_before_their_loop_closes():
  """Within: every new event loop (so Orbax's restore and save loops, in any thread) finishes
  its tasks before closing."""
  previous = asyncio.get_event_loop_policy()
  asyncio.set_event_loop_policy(_LoopPolicy())
  try:
    yield
  finally:
    asyncio.set_event_loop_policy(previous)


def save_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Writes workdir/config.json (process 0 only), whole or not at all."""
  if jax.process_index() == 0:
    path = epath.Path(workdir) / CONFIG_FILE
    with storage.writing(str(path)):
      path.parent.mkdir(parents=True, exist_ok=True)
      partial = path.parent / (CONFIG_FILE + ".partial")
      partial.write_text(config.to_json_best_effort(indent=2, sort_keys=True))
      partial.replace(path)


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """The configuration saved in `workdir` by train.py (an earlier version's in today's spelling)."""
  path = epath.Path(workdir) / CONFIG_FILE
  if not path.exists():
    raise FileNotFoundError(
        f"{path} not found: is {workdir!r} a workdir written by train.py?")
  saved = base.read_saved(str(path), path.read_text())
  if isinstance(saved.get("model"), dict):  # an earlier version's model config in today's form
    saved["model"] = models.config.upgrade(saved["model"])
  return base.from_saved(saved)


class Checkpointer:
  """Async Orbax CheckpointManager over the model, optimizer and data state.

  A write that fails (a full disk, a folder made read-only) raises storage.WriteFailed
  naming the step's folder: at once when its folder cannot be made (Orbax makes it in the
  calling thread here, not in a background thread whose failure would leave the save
  waiting for it), else at the next save, `check` or `close`. Orbax's temporary folders of
  a save that did not complete are removed when the next run opens the directory.
  """

  def __init__(self, workdir: str, *, every_steps: int, keep: int,
               async_save: bool = True):
    if every_steps <= 0:
      raise ValueError(
          f"config.checkpoint_every_steps must be positive, got {every_steps}.")
    if keep <= 0:
      raise ValueError(f"config.keep_checkpoints must be positive, got {keep}.")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, save_interval_steps=every_steps,
        enable_async_checkpointing=async_save, create=True, cleanup_tmp_directories=True,
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
    self._workdir = os.path.abspath(workdir)
    self.directory = os.path.join(self._workdir, CHECKPOINT_DIR)
    self._writing: int | None = None  # the step of a save that may still be running
    with storage.writing(self.directory):
      self._manager = ocp.CheckpointManager(
          self.directory, item_names=("model", "optimizer", "data"), options=options)

  def _step_path(self, step: int | None) -> str:
    return self.directory if step is None else os.path.join(self.directory, str(step))

  def save(self, step: int, state: dict, data_iterator: Any,
           force: bool = False) -> bool:
    """Saves at `step` if the interval says so (or `force`); returns whether it did.

    Raises:
      storage.WriteFailed: this save, or the earlier one still running, failed.
    """
    with storage.writing(self._step_path(self._writing)):
      self._manager.wait_until_finished()
    with storage.writing(self._step_path(step)):
      saved = self._manager.save(
          step,
          args=ocp.args.Composite(
              model=ocp.args.StandardSave(
                  {"params": state["params"], "model_state": state["model_state"]}),
              optimizer=ocp.args.StandardSave(
                  {"step": state["step"], "opt_state": state["opt_state"]}),
              data=grain.checkpoint.CheckpointSave(data_iterator)),
          force=force)
    self._writing = step if saved else self._writing
    return saved

  def check(self) -> None:
    """Raises storage.WriteFailed if a save that ran in the background has failed; returns
    at once while one is still running."""
    if self._writing is not None and not self._manager.is_saving_in_progress():
      with storage.writing(self._step_path(self._writing)):
        self._manager.wait_until_finished()
      self._writing = None  # written

  def _restore(self, step: int, abstract_state: dict, data_iterator: Any) -> dict:
    """Restores the train state onto the shardings in `abstract_state`.

    The data iterator is restored in place.
    """
    with tasks_finish_before_their_loop_closes():
      restored = self._manager.restore(
          step,
          args=ocp.args.Composite(
              model=ocp.args.StandardRestore(
                  {"params": abstract_state["params"],
                   "model_state": abstract_state["model_state"]}),
              optimizer=ocp.args.StandardRestore(
                  {"step": abstract_state["step"],
                   "opt_state": abstract_state["opt_state"]}),
              data=grain.checkpoint.CheckpointRestore(data_iterator)))
    return {**restored["model"], **restored["optimizer"]}

  def restore_latest(self, abstract_state: dict, data_iterator: Any
                     ) -> tuple[int | None, dict | None]:
    """(step, state) of the newest checkpoint that restores; (None, None) if none exist.

    The data iterator is restored in place. Newer checkpoints that cannot be
    read (a truncated array file, a missing item or data file) are moved to
    <workdir>/corrupt_checkpoints/ (never deleted), each with one warning,
    once an older one has restored.

    Raises:
      CheckpointError: checkpoints exist but none of them restores (nothing
        is moved then: a changed model config fails this way too).
    """
    failures = []
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        state = self._restore(step, abstract_state, data_iterator)
      except Exception as error:  # pylint: disable=broad-exception-caught
        failures.append((step, _first_line(error)))
        continue
      for bad_step, failure in failures:
        dest = self._move_aside(bad_step)
        if jax.process_index() == 0:
          warnings.warn(
              f"checkpoint step {bad_step} in {self._workdir}/{CHECKPOINT_DIR} cannot "
              f"be restored ({failure}); moved it to {dest} and resumed from step "
              f"{step}.", RuntimeWarning, stacklevel=2)
      self._manager.reload()
      return step, state
    if failures:
      steps = ", ".join(str(s) for s, _ in failures)
      raise CheckpointError(
          f"no checkpoint in {self._workdir}/{CHECKPOINT_DIR} restores (steps {steps}); "
          f"the newest, step {failures[0][0]}: {failures[0][1].rstrip('.:')}. Move the folder "
          "aside to start afresh, or fix the config if it changed.")
    return None, None

  def _move_aside(self, step: int) -> str:
    """Moves checkpoints/<step> to corrupt_checkpoints/<step>-<UTC time> (process 0)."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    dest = os.path.join(self._workdir, CORRUPT_DIR, f"{step}-{stamp}")
    if jax.process_index() == 0:
      os.makedirs(os.path.dirname(dest), exist_ok=True)
      shutil.move(os.path.join(self._workdir, CHECKPOINT_DIR, str(step)), dest)
    return dest

  def close(self) -> None:
    """Waits for the last save; raises storage.WriteFailed if it failed."""
    with storage.writing(self._step_path(self._writing)):
      try:
        self._manager.wait_until_finished()
      finally:
        self._manager.close()


def save_params(dest: str, params: Any) -> None:
  """Writes `params` (pure dict of arrays) as the parameters-only checkpoint of `dest`."""
  path = epath.Path(os.path.abspath(dest)) / PARAMS_DIR
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, {"params": params})


def restore_params(dest: str, abstract_params: Any) -> Any:
  """The parameters saved by save_params, restored onto `abstract_params`' shapes and shardings.

  Args:
    dest: a directory holding a parameters-only checkpoint (a conversion output).
    abstract_params: pure dict of jax.ShapeDtypeStruct (with shardings), e.g.
      the "params" entry of a train state's abstract tree.
  """
  path = epath.Path(os.path.abspath(dest)) / PARAMS_DIR
  with (ocp.StandardCheckpointer() as checkpointer,
        tasks_finish_before_their_loop_closes()):
    return checkpointer.restore(path, {"params": abstract_params})["params"]


def workdir_of(checkpoint: str) -> str:
  """The absolute train.py workdir of a workdir or of its checkpoints/<step> folder."""
  path = os.path.abspath(checkpoint)
  name, parent = os.path.basename(path), os.path.dirname(path)
  if name.isdigit() and os.path.basename(parent) == CHECKPOINT_DIR:
    return os.path.dirname(parent)
  return path


def _resolve(checkpoint: str) -> tuple[str, int | None]:
  """(workdir, step or None for the latest) from a workdir or a step directory."""
  if not os.path.exists(checkpoint):
    raise FileNotFoundError(f"checkpoint={checkpoint!r} does not exist.")
  path = epath.Path(checkpoint)
  if (path / CONFIG_FILE).exists():
    return str(path), None
  workdir = workdir_of(checkpoint)
  if workdir != os.path.abspath(checkpoint):
    return workdir, int(path.name)
  raise FileNotFoundError(
      f"checkpoint={checkpoint!r} is neither a workdir written by train.py "
      f"(holding {CONFIG_FILE}) nor one of its {CHECKPOINT_DIR}/<step> folders.")


def load_model(checkpoint: str) -> tuple[Any, ml_collections.ConfigDict, int]:
  """Restores a trained model (parameters only) onto the current devices.

  Args:
    checkpoint: a workdir written by train.py (its latest step is loaded) or
      one of its checkpoints/<step> folders.

  Returns:
    (NNX model, the run's config, step).
  """
  workdir, step = _resolve(checkpoint)
  config = load_config(workdir)
  manager = ocp.CheckpointManager(
      os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR),
      item_names=("model", "optimizer", "data"))
  step = manager.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"no checkpoint under {workdir}/{CHECKPOINT_DIR}.")
  parts = models.abstract_model(state_lib.run_model_fn(config), config.seed)
  abstract = models.abstract_on_first_local_device(parts)
  try:
    with tasks_finish_before_their_loop_closes():
      restored = manager.restore(
          step, args=ocp.args.Composite(model=ocp.args.StandardRestore(abstract)))
  except Exception as error:  # pylint: disable=broad-exception-caught
    others = [s for s in manager.all_steps() if s != step]
    hint = f" Other steps there: {sorted(others)}." if others else ""
    raise CheckpointError(
        f"cannot read step {step} of {workdir}/{CHECKPOINT_DIR}/{step}: "
        f"{_first_line(error).rstrip('.:')}.{hint}") from None
  finally:
    manager.close()
  model = models.merge_model(parts.graphdef, restored["model"]["params"],
                             restored["model"]["model_state"])
  return model, config, int(step)
