"""Reading the authors' PyTorch checkpoints into conversion destinations, and writing them back.

import_checkpoint reads the authors' config.json and *.safetensors with numpy
(no torch) and writes a conversion destination (conversion.json + converted/,
checkpoint.py), the directory fine-tuning, evaluation and generation load.
export_checkpoint reads such a destination or a train.py workdir and writes
config.json + model.safetensors (float32) for the authors' `from_pretrained`, and the
model's tokenizer as tokenizer.json, which an import copies back.
Tensor names and the options that do not map are in torch_layouts.py; the
command line is torch_models.py; docs/torch_models.md explains both.
"""

import json
import os
import shutil
import sys
from typing import Any

from flax import nnx
import jax
import ml_collections
import numpy as np
from safetensors.numpy import save_file

from palimpsa_jax import models
from palimpsa_jax.conversion import checkpoint as checkpoint_lib
from palimpsa_jax.conversion import hf_mamba2
from palimpsa_jax.conversion import torch_layouts as layouts
from palimpsa_jax.conversion import windows as windows_lib
from palimpsa_jax.data import tokenizer as tokenizer_lib
from palimpsa_jax.training import checkpoint as train_checkpoint
from palimpsa_jax.training import storage

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = checkpoint_lib.TOKENIZER_FILE


def _to_ours(kind: str, value: np.ndarray) -> np.ndarray:
  if kind == "linear":
    return value.T
  if kind == "conv":
    return value[:, 0, :].T  # [C, 1, W] -> [W, C]
  return value


def _to_torch(kind: str, value: np.ndarray) -> np.ndarray:
  if kind == "linear":
    return value.T
  if kind == "conv":
    return value.T[:, None, :]  # [W, C] -> [C, 1, W]
  return value


def tensors_to_params(tensors: dict[str, np.ndarray], config: ml_collections.ConfigDict,
                      source: str = "source") -> dict[tuple, np.ndarray]:
  """{our parameter path: float32 array} from the authors' tensors; strict.

  Raises:
    ValueError: naming the unmapped and the missing tensors, the first tensor
      of a wrong shape, or an lm_head.weight that is not the embedding.
  """
  table = layouts.tensor_table(config)
  hf_mamba2.check_tensor_names(tensors, {t.name for t in table}, {layouts.LM_HEAD}, source)
  params = {}
  for t in table:
    value = tensors[t.name]
    if tuple(value.shape) != t.shape:
      raise ValueError(f"{source}: tensor {t.name!r} has shape {tuple(value.shape)}, "
                       f"expected {t.shape}")
    if t.path is not None:
      params[t.path] = np.ascontiguousarray(_to_ours(t.kind, np.asarray(value, np.float32)))
  if layouts.LM_HEAD in tensors:
    head = np.asarray(tensors[layouts.LM_HEAD], np.float32)
    if head.shape != params[("embed",)].shape or not np.array_equal(head, params[("embed",)]):
      raise ValueError(
          f"{source}: tensor {layouts.LM_HEAD!r} differs from the embedding: an untied "
          "output head has no counterpart (our models tie the head to the embedding)")
  return params


def _build_model(config: ml_collections.ConfigDict, params: dict[tuple, np.ndarray]):
  """Our NNX model holding `params` (keyed by path); ValueError if they do not fit it."""
  parts = models.abstract_model(lambda rngs: models.build_model(config, rngs))
  given = {tuple(str(k) for k in path): value for path, value in params.items()}
  abstract = nnx.to_pure_dict(parts.abstract_params)
  wanted = {models.path_names(path): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(abstract)}
  if set(wanted) != set(given):
    raise ValueError(
        f"mapped parameters do not fit the model: missing {sorted(set(wanted) - set(given))}, "
        f"extra {sorted(set(given) - set(wanted))}")

  def pick(path, leaf):
    value = given[models.path_names(path)]
    if value.shape != leaf.shape:
      raise ValueError(f"parameter {'/'.join(models.path_names(path))} has shape "
                       f"{value.shape}, the model expects {leaf.shape}")
    return jax.numpy.asarray(value)

  tree = jax.tree_util.tree_map_with_path(pick, abstract)
  model_state = nnx.to_pure_dict(parts.abstract_model_state)
  if jax.tree_util.tree_leaves(model_state):
    raise ValueError("the model has non-parameter variables, which an import cannot fill")
  return models.merge_model(parts.graphdef, tree, model_state)


def read_source(source: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """(config.json, tensors) of the authors' checkpoint directory `source`."""
  if not os.path.isdir(source):
    raise FileNotFoundError(f"--source {source!r} must be a directory holding "
                            f"{CONFIG_FILE} and *.safetensors")
  config_path = os.path.join(source, CONFIG_FILE)
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"{config_path} not found: the model type comes from it")
  with open(config_path) as f:
    hf_config = json.load(f)
  return hf_config, hf_mamba2.read_tensors(source)


def import_checkpoint(source: str, dest: str, *, dtype: str = "float32",
                      verbose: bool = True) -> dict[str, Any]:
  """Writes the authors' checkpoint `source` as a conversion destination `dest`.

  Args:
    source: directory with config.json and *.safetensors (model_type palimpsa
      or meta_mamba2).
    dest: output directory (conversion.json + converted/); must not hold one.
    dtype: compute dtype of our model (parameters stay float32).
    verbose: print what was done.

  Returns:
    The conversion info written beside the model config.
  """
  checkpoint_lib.check_dest_free(dest)
  hf_config, tensors = read_source(source)
  config = layouts.our_config(hf_config, dtype, source)
  params = tensors_to_params(tensors, config, source)
  model = _build_model(config, params)
  _, nested, _ = models.split_model(model)
  dt = windows_lib.bias_dt(nested, config.num_layers)
  info = {"source": os.path.abspath(source), "source_kind": f"authors_{hf_config['model_type']}",
          "source_step": None, "layers": [], "init": "imported", "seed": None,
          "windows": windows_lib.layer_windows(nested, dt).tolist(),
          "dt_source": "softplus(dt_bias)"}
  checkpoint_lib.write_conversion(dest, model, config, info)
  if os.path.isfile(os.path.join(source, TOKENIZER_FILE)):
    shutil.copyfile(os.path.join(source, TOKENIZER_FILE), os.path.join(dest, TOKENIZER_FILE))
  if verbose:
    print(f"imported the authors' {hf_config['model_type']} model {source} as our "
          f"{config.model} -> {dest}", flush=True)
  return info


def load_ours(checkpoint: str) -> tuple[dict, ml_collections.ConfigDict]:
  """(parameter pure dict, model config) of a conversion destination or train.py workdir (a
  destination fine-tuned in place is that run's workdir: its latest step)."""
  if checkpoint_lib.is_conversion(checkpoint):
    model, config, _ = checkpoint_lib.load_converted(checkpoint)
  else:
    model, run_config, _ = train_checkpoint.load_model(checkpoint)
    config = run_config.model
  _, params, _ = models.split_model(model)
  params = jax.tree.map(np.asarray, params)
  if config.get("scan_layers"):
    stacked = params["blocks"]
    params["blocks"] = {i: jax.tree.map(lambda x, i=i: x[i], stacked)
                        for i in range(config.num_layers)}
  return params, config


def params_to_tensors(params: dict, config: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
  """The authors' tensors (float32, lm_head included) of our parameter pure dict.

  Raises:
    ValueError: a parameter with no counterpart there (a non-zero beta_up bias,
      say), or any model authors_model_type rejects.
  """
  flat = {models.path_names(path): np.asarray(leaf, np.float32)
          for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
  tensors = {}
  for t in layouts.tensor_table(config):
    if t.path is None:
      tensors[t.name] = np.full(t.shape, t.fill, np.float32)
      continue
    key = tuple(str(k) for k in t.path)
    tensors[t.name] = np.ascontiguousarray(_to_torch(t.kind, flat.pop(key)))
    if tensors[t.name].shape != t.shape:
      raise ValueError(f"parameter {'/'.join(key)} gives {t.name!r} the shape "
                       f"{tensors[t.name].shape}, expected {t.shape}")
  for key, value in flat.items():
    if key[-2:] == ("beta_up", "bias") and not np.any(value):
      continue  # a zero bias is the authors' bias-free projection
    raise ValueError(
        f"parameter {'/'.join(key)} has no counterpart in the authors' model"
        + (" (their b_proj has no bias; this one is not zero: train with "
           "config.model.beta_bias=False, the default of models trained since it became one)"
           if key[-2:] == ("beta_up", "bias") else ""))
  tensors[layouts.LM_HEAD] = params["embed"].astype(np.float32)  # tied to the embedding
  return tensors


def tokenizer_file(checkpoint: str) -> str | None:
  """The tokenizer.json the model at `checkpoint` reads text with (its run config's
  data.tokenizer); None for a model without one (MQAR).

  Raises:
    FileNotFoundError: the run's tokenizer file is not where it was.
  """
  if checkpoint_lib.is_conversion(checkpoint):
    config = checkpoint_lib.run_config(checkpoint, *checkpoint_lib.read_conversion(checkpoint))
  else:
    config = train_checkpoint.load_config(train_checkpoint.workdir_of(checkpoint))
  spec = config.get("data", {}).get("tokenizer")
  if not spec:
    return None
  return tokenizer_lib.find_tokenizer_file(spec, checkpoint_lib.tokenizer_folder(checkpoint))


def export_checkpoint(checkpoint: str, dest: str, *, verbose: bool = True) -> str:
  """Writes our model at `checkpoint` as the authors' config.json + model.safetensors in `dest`,
  with its tokenizer as tokenizer.json (which import_checkpoint brings back).

  Returns:
    The authors' model_type written.
  """
  for name in (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE):
    if os.path.exists(os.path.join(dest, name)):
      raise FileExistsError(f"{os.path.join(dest, name)} exists; choose another --dest")
  try:
    tokenizer = tokenizer_file(checkpoint)
  except FileNotFoundError as missing:  # the weights are still worth exporting
    tokenizer = None
    if verbose:
      print(f"exporting without a tokenizer: {missing}", file=sys.stderr, flush=True)
  params, config = load_ours(checkpoint)
  hf_config = layouts.authors_config(config)
  tensors = params_to_tensors(params, config)
  with storage.writing(dest):
    os.makedirs(dest, exist_ok=True)
  weights = os.path.join(dest, WEIGHTS_FILE)
  with storage.writing(weights):
    save_file(tensors, weights + ".tmp", metadata={"format": "pt"})
    os.replace(weights + ".tmp", weights)
  storage.write_whole(os.path.join(dest, CONFIG_FILE),
                      json.dumps(hf_config, indent=2, sort_keys=True))
  if tokenizer:
    with storage.writing(os.path.join(dest, TOKENIZER_FILE)):
      shutil.copyfile(tokenizer, os.path.join(dest, TOKENIZER_FILE))
  if verbose:
    print(f"exported our {config.model} model {checkpoint} as the authors' "
          f"{hf_config['model_type']} -> {dest}"
          f"{f' with its tokenizer ({tokenizer})' if tokenizer else ''}", flush=True)
  return hf_config["model_type"]
