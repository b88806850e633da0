"""What eval.py and generate.py accept as --checkpoint, loaded as a model and its run config.

A checkpoint is one of
  - a train.py workdir (its latest step) or one of its checkpoints/<step> folders;
  - a conversion output (`python -m palimpsa_jax.conversion --dest DIR`), as converted: its
    model with the run config of the source it was converted from (conversion/checkpoint.py,
    run_config). Its step is 0 (not trained since conversion).
A conversion output in which a fine-tuning run has written its own checkpoints is that run's
workdir.

A run is read with its saved config (config.json, never rewritten by a resume): what the model
is and what it was trained on. A command that asks for another task is refused (require_task).
"""

from __future__ import annotations

from typing import Any

import ml_collections

from palimpsa_jax import user_errors
from palimpsa_jax.conversion import checkpoint as conversion_lib
from palimpsa_jax.training import checkpoint as checkpoint_lib


class OtherTask(ValueError, user_errors.UserError):
  """The checkpoint's run was trained on another task than the command evaluates."""


def require_task(checkpoint: str, config: ml_collections.ConfigDict, task: str,
                 needed_by: str) -> None:
  """Raises OtherTask (one line) unless the run config's task is `task`.

  Args:
    needed_by: what needs it, for the message ("the mqar suite").
  """
  trained = config.get("task", "lm")  # a Hugging Face conversion has no run of its own: lm
  if trained != task:
    raise OtherTask(f"checkpoint {checkpoint} was trained on task {trained!r} (its saved "
                    f"config); {needed_by} needs a run of task {task!r}.")


def load_model(checkpoint: str) -> tuple[Any, ml_collections.ConfigDict, int]:
  """(NNX model on the first local device, run config, step) of any accepted checkpoint."""
  if not conversion_lib.is_conversion(checkpoint):
    return checkpoint_lib.load_model(checkpoint)
  model, model_config, info = conversion_lib.load_converted(checkpoint)
  return model, conversion_lib.run_config(checkpoint, model_config, info), 0
