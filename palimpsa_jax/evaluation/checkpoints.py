"""What eval.py and generate.py accept as --checkpoint, loaded as a model and its run config.

A checkpoint is one of
  - a train.py workdir (its latest step) or one of its checkpoints/<step> folders;
  - a conversion output (`python -m palimpsa_jax.conversion --dest DIR`), as converted: its
    model with the run config of the source it was converted from (data, task, tokenizer,
    sequence length), or for a Hugging Face source an LM config with the tokenizer.json found
    beside the source and a 2048-token context. Its step is 0 (not trained since conversion).
A conversion output in which a fine-tuning run has written its own checkpoints is that run's
workdir.

A run is read with its saved config (config.json, never rewritten by a resume): what the model
is and what it was trained on. A command that asks for another task is refused (require_task).
"""

from __future__ import annotations

import os
from typing import Any

import ml_collections

from palimpsa_jax import user_errors
from palimpsa_jax.conversion import checkpoint as conversion_lib
from palimpsa_jax.training import checkpoint as checkpoint_lib

# Context of the published Hugging Face Mamba2 models' pretraining.
HF_SEQ_LEN = 2048


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


def is_conversion(checkpoint: str) -> bool:
  """True for a conversion output in which no train.py run has written its config."""
  return (os.path.isfile(os.path.join(checkpoint, conversion_lib.CONVERSION_FILE))
          and not os.path.isfile(os.path.join(checkpoint, checkpoint_lib.CONFIG_FILE)))


def _conversion_run_config(dest: str, model_config: ml_collections.ConfigDict,
                           info: dict[str, Any]) -> ml_collections.ConfigDict:
  """The source's run config with the converted model (see the module docstring)."""
  source = info["source"]
  if info["source_kind"] != "orbax":
    return ml_collections.ConfigDict({
        "task": "lm", "seq_len": HF_SEQ_LEN, "seed": 0, "model": model_config,
        "data": {"tokenizer": os.path.join(
            source if os.path.isdir(source) else os.path.dirname(source), "tokenizer.json")}})
  workdir = checkpoint_lib.workdir_of(source)
  if not os.path.isfile(os.path.join(workdir, checkpoint_lib.CONFIG_FILE)):
    raise FileNotFoundError(
        f"conversion {dest!r} was made from {source!r}, whose run config "
        f"{checkpoint_lib.CONFIG_FILE} (task, data, tokenizer) is needed and not found there")
  config = checkpoint_lib.load_config(workdir)
  config.model = model_config
  if "args" in config:  # The source's config arguments (its mixer, ...) no longer describe it.
    del config["args"]
  return config


def load_model(checkpoint: str) -> tuple[Any, ml_collections.ConfigDict, int]:
  """(NNX model on the first local device, run config, step) of any accepted checkpoint."""
  if not is_conversion(checkpoint):
    return checkpoint_lib.load_model(checkpoint)
  model, model_config, info = conversion_lib.load_converted(checkpoint)
  return model, _conversion_run_config(checkpoint, model_config, info), 0


def tokenizer_folder(checkpoint: str) -> str:
  """Where a run's "bpe:<n>" tokenizer is looked for (with its parents): for a conversion, the
  source checkpoint's folder."""
  if is_conversion(checkpoint):
    _, info = conversion_lib.read_conversion(checkpoint)
    return info["source"]
  return checkpoint
