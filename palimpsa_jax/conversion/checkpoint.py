"""The conversion output: an Orbax parameter checkpoint plus its config.

dest/
  conversion.json   {"model": model config, "source", "source_kind", "layers",
                     "init", "seed", "windows": [[per-head N] per layer], "dt_source"}
  converted/        Orbax StandardCheckpointer: {"params": parameter tree}
                    (training/checkpoint.py's parameters-only checkpoint)
A fine-tuning run in dest (configs/finetune.py:source=dest) initialises its
parameters from converted/ with a fresh optimizer at step 0; train.py's own
checkpoints then go to dest/checkpoints/ as usual.
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

CONVERSION_FILE = "conversion.json"


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
  dest_path.mkdir(parents=True, exist_ok=True)
  _, params, _ = models.split_model(model)
  checkpoint_lib.save_params(dest, params)
  record = {"model": json.loads(config.to_json_best_effort()), **info}
  (dest_path / CONVERSION_FILE).write_text(json.dumps(record, indent=2, sort_keys=True))


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
