"""The conversion output: an Orbax parameter checkpoint plus its config.

dest/
  conversion.json   {"model": model config, "source", "source_kind", "layers",
                     "init", "seed", "windows": [[per-head N] per layer], "dt_source"}
  converted/        Orbax StandardCheckpointer: {"params": parameter tree}
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
import orbax.checkpoint as ocp

CONVERSION_FILE = "conversion.json"
PARAMS_DIR = "converted"


def check_dest_free(dest: str) -> None:
  """Raises FileExistsError when `dest` already holds a conversion."""
  dest_path = epath.Path(os.path.abspath(dest))
  if (dest_path / PARAMS_DIR).exists() or (dest_path / CONVERSION_FILE).exists():
    raise FileExistsError(f"{dest} already holds a conversion; choose another --dest")


def write_conversion(dest: str, model: nnx.Module, config: ml_collections.ConfigDict,
                     info: dict[str, Any]) -> None:
  """Saves the model's parameters and `info` (+ the model config) into `dest`."""
  from palimpsa_jax.training import state as state_lib  # pylint: disable=g-import-not-at-top
  check_dest_free(dest)
  dest_path = epath.Path(os.path.abspath(dest))
  dest_path.mkdir(parents=True, exist_ok=True)
  _, params, _ = state_lib.split_model(model)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(dest_path / PARAMS_DIR, {"params": params})
  record = {"model": json.loads(config.to_json_best_effort()), **info}
  (dest_path / CONVERSION_FILE).write_text(json.dumps(record, indent=2, sort_keys=True))


def read_conversion(dest: str) -> tuple[ml_collections.ConfigDict, dict[str, Any]]:
  """(model config, the rest of conversion.json) written by write_conversion."""
  path = epath.Path(dest) / CONVERSION_FILE
  if not path.exists():
    raise FileNotFoundError(f"{path} not found: is {dest!r} a conversion output?")
  record = json.loads(path.read_text())
  config = ml_collections.ConfigDict(record.pop("model"))
  return config, record


def restore_params(dest: str, abstract_params: Any) -> Any:
  """The converted parameters, restored onto `abstract_params`' shapes and shardings.

  Args:
    dest: a conversion output directory.
    abstract_params: pure dict of jax.ShapeDtypeStruct (with shardings), e.g.
      the "params" entry of a train state's abstract tree.
  """
  path = epath.Path(os.path.abspath(dest)) / PARAMS_DIR
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(path, {"params": abstract_params})["params"]


def load_converted(dest: str) -> tuple[nnx.Module, ml_collections.ConfigDict, dict[str, Any]]:
  """(NNX model on the first local device, model config, conversion info)."""
  # pylint: disable=g-import-not-at-top
  from palimpsa_jax import models
  from palimpsa_jax.training import state as state_lib
  # pylint: enable=g-import-not-at-top
  config, info = read_conversion(dest)
  parts = state_lib.abstract_model(lambda rngs: models.build_model(config, rngs))
  abstract = state_lib.abstract_on_first_local_device(parts)
  params = restore_params(dest, abstract["params"])
  return (state_lib.merge_model(parts.graphdef, params, abstract["model_state"]),
          config, info)
