"""The conversion output: an Orbax parameter checkpoint plus its config.

dest/
  conversion.json   {"model": model config, "source", "source_kind", "layers",
                     "init", "seed", "windows": [[per-head N] per layer], "dt_source"}
  converted/        Orbax StandardCheckpointer: {"params": parameter tree}
                    (training/checkpoint.py's parameters-only checkpoint)
  tokenizer.json    an imported model's tokenizer (torch_checkpoints.py), if it had one
A fine-tuning run in dest (configs/finetune.py:source=dest) initialises its
parameters from converted/ with a fresh optimizer at step 0; train.py's own
checkpoints then go to dest/checkpoints/ as usual.

As a checkpoint to evaluate, sample or export, a conversion output is its model with the run
config of its source (`run_config`): a train.py run's config (data, task, tokenizer, sequence
length), or for a Hugging Face or authors' source an LM config with a 2048-token context and
the tokenizer.json in dest, else beside the source.
"""

import json
import os
from typing import Any

from etils import epath
from flax import nnx
import ml_collections

from palimpsa_jax import models
from palimpsa_jax.run_config import base
from palimpsa_jax.training import checkpoint as checkpoint_lib
from palimpsa_jax.training import storage

CONVERSION_FILE = "conversion.json"
TOKENIZER_FILE = "tokenizer.json"
# Context of the published Hugging Face Mamba2 models' pretraining.
HF_SEQ_LEN = 2048


def check_dest_free(dest: str) -> None:
  """Raises FileExistsError when `dest` already holds a conversion."""
  dest_path = epath.Path(os.path.abspath(dest))
  if (dest_path / checkpoint_lib.PARAMS_DIR).exists() or (dest_path / CONVERSION_FILE).exists():
    raise FileExistsError(f"{dest} already holds a conversion; choose another --dest")


def write_conversion(dest: str, model: nnx.Module, config: ml_collections.ConfigDict,
                     info: dict[str, Any]) -> None:
  """Saves the model's parameters and `info` (+ the model config) into `dest`."""
  check_dest_free(dest)
  dest_path = epath.Path(os.path.abspath(dest))
  _, params, _ = models.split_model(model)
  with storage.writing(dest):
    dest_path.mkdir(parents=True, exist_ok=True)
    checkpoint_lib.save_params(dest, params)
  record = {"model": json.loads(config.to_json_best_effort()), **info}
  storage.write_whole(str(dest_path / CONVERSION_FILE),
                      json.dumps(record, indent=2, sort_keys=True))


def read_conversion(dest: str) -> tuple[ml_collections.ConfigDict, dict[str, Any]]:
  """(model config, the rest of conversion.json) written by write_conversion."""
  path = epath.Path(dest) / CONVERSION_FILE
  if not path.exists():
    raise FileNotFoundError(f"{path} not found: is {dest!r} a conversion output?")
  record = base.read_saved(str(path), path.read_text())
  config = models.config.upgrade(record.pop("model"))  # an earlier version's in today's form
  return config, record


def load_converted(dest: str) -> tuple[nnx.Module, ml_collections.ConfigDict, dict[str, Any]]:
  """(NNX model on the first local device, model config, conversion info)."""
  config, info = read_conversion(dest)
  parts = models.abstract_model(lambda rngs: models.build_model(config, rngs))
  abstract = models.abstract_on_first_local_device(parts)
  params = checkpoint_lib.restore_params(dest, abstract["params"])
  return (models.merge_model(parts.graphdef, params, abstract["model_state"]),
          config, info)


def is_conversion(checkpoint: str) -> bool:
  """True for a conversion output in which no train.py run has written its config."""
  return (os.path.isfile(os.path.join(checkpoint, CONVERSION_FILE))
          and not os.path.isfile(os.path.join(checkpoint, checkpoint_lib.CONFIG_FILE)))


def run_config(dest: str, model_config: ml_collections.ConfigDict,
               info: dict[str, Any]) -> ml_collections.ConfigDict:
  """The run config of conversion output `dest` (see the module docstring)."""
  source = info.get("source")
  if info.get("source_kind") != "orbax":
    tokenizer = os.path.join(dest, TOKENIZER_FILE)
    if not os.path.isfile(tokenizer) and source:
      tokenizer = os.path.join(source if os.path.isdir(source) else os.path.dirname(source),
                               TOKENIZER_FILE)
    return ml_collections.ConfigDict({
        "task": "lm", "seq_len": HF_SEQ_LEN, "seed": 0, "model": model_config,
        "data": {"tokenizer": tokenizer}})
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


def tokenizer_folder(checkpoint: str) -> str:
  """Where a checkpoint's "bpe:<n>" tokenizer is looked for (with its parents): the checkpoint
  itself, or for a conversion output its source."""
  if is_conversion(checkpoint):
    _, info = read_conversion(checkpoint)
    return info.get("source") or checkpoint
  return checkpoint
