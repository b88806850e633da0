"""Orbax checkpoints of a training run, and loading a trained model back.

A workdir written by train.py holds:
  config.json            the run's configuration (to rebuild the model)
  checkpoints/<step>/    Orbax items: "model" {params, model_state},
                         "optimizer" {step, opt_state}, "data" (grain
                         iterator state, one JSON file per host)
  metrics.jsonl          see training/metrics.py
"""

import json
import os
from typing import Any

import grain
import jax
import ml_collections
import orbax.checkpoint as ocp
from etils import epath

from palimpsa_jax.training import state as state_lib

CONFIG_FILE = "config.json"
CHECKPOINT_DIR = "checkpoints"


def save_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Writes workdir/config.json (process 0 only)."""
  if jax.process_index() == 0:
    path = epath.Path(workdir) / CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config.to_json_best_effort(indent=2, sort_keys=True))


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """The configuration saved in `workdir` by train.py."""
  path = epath.Path(workdir) / CONFIG_FILE
  if not path.exists():
    raise FileNotFoundError(
        f"{path} not found: is {workdir!r} a workdir written by train.py?")
  return ml_collections.ConfigDict(json.loads(path.read_text()))


class Checkpointer:
  """Async Orbax CheckpointManager over the model, optimizer and data state."""

  def __init__(self, workdir: str, *, every_steps: int, keep: int,
               async_save: bool = True):
    if every_steps <= 0:
      raise ValueError(
          f"config.checkpoint_every_steps must be positive, got {every_steps}.")
    if keep <= 0:
      raise ValueError(f"config.keep_checkpoints must be positive, got {keep}.")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, save_interval_steps=every_steps,
        enable_async_checkpointing=async_save, create=True)
    self._manager = ocp.CheckpointManager(
        os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR),
        item_names=("model", "optimizer", "data"), options=options)

  @property
  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: dict, data_iterator: Any,
           force: bool = False) -> bool:
    """Saves at `step` if the interval says so (or `force`); returns whether it did."""
    return self._manager.save(
        step,
        args=ocp.args.Composite(
            model=ocp.args.StandardSave(
                {"params": state["params"], "model_state": state["model_state"]}),
            optimizer=ocp.args.StandardSave(
                {"step": state["step"], "opt_state": state["opt_state"]}),
            data=grain.checkpoint.CheckpointSave(data_iterator)),
        force=force)

  def restore(self, step: int, abstract_state: dict, data_iterator: Any) -> dict:
    """Restores the train state onto the shardings in `abstract_state`.

    The data iterator is restored in place.
    """
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

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def workdir_of(checkpoint: str) -> str:
  """The absolute train.py workdir of a workdir or of its checkpoints/<step> folder."""
  path = os.path.abspath(checkpoint)
  name, parent = os.path.basename(path), os.path.dirname(path)
  if name.isdigit() and os.path.basename(parent) == CHECKPOINT_DIR:
    return os.path.dirname(parent)
  return path


def _resolve(checkpoint: str) -> tuple[str, int | None]:
  """(workdir, step or None for the latest) from a workdir or a step directory."""
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
  # Imported here: the trainer module imports this one.
  from palimpsa_jax.training import trainer  # pylint: disable=g-import-not-at-top
  workdir, step = _resolve(checkpoint)
  config = load_config(workdir)
  manager = ocp.CheckpointManager(
      os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR),
      item_names=("model", "optimizer", "data"))
  step = manager.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"no checkpoint under {workdir}/{CHECKPOINT_DIR}.")
  parts = state_lib.abstract_model(trainer.model_fn(config), config.seed)
  abstract = state_lib.abstract_on_first_local_device(parts)
  restored = manager.restore(
      step, args=ocp.args.Composite(model=ocp.args.StandardRestore(abstract)))
  manager.close()
  model = state_lib.merge_model(parts.graphdef, restored["model"]["params"],
                                restored["model"]["model_state"])
  return model, config, int(step)
