"""Hugging Face Mamba2 checkpoints in safetensors -> our Mamba2 parameters and config.

Two weight layouts are read (N is the layer index):
  transformers (Mamba2ForCausalLM):  backbone.embeddings.weight
  mamba_ssm (MambaLMHeadModel):      backbone.embedding.weight
and, in both,
  backbone.layers.N.norm.weight                           [d]
  backbone.layers.N.mixer.in_proj.weight                  [2 Di + 2 G Ns + H, d]
  backbone.layers.N.mixer.conv1d.weight                   [Di + 2 G Ns, 1, W]
  backbone.layers.N.mixer.conv1d.bias                     [Di + 2 G Ns]
  backbone.layers.N.mixer.{A_log, D, dt_bias}             [H]
  backbone.layers.N.mixer.norm.weight                     [Di]
  backbone.layers.N.mixer.out_proj.weight                 [d, Di]
  backbone.norm_f.weight                                  [d]
  lm_head.weight (optional; must equal the embedding)     [V, d]
Every tensor must be mapped and every expected tensor present; otherwise a
ValueError names them. Torch Linear weights are [out, in]; ours are [in, out].
"""

import dataclasses
import glob
import json
import math
import os
import re
from typing import Any

import ml_collections
import numpy as np
from safetensors.numpy import load_file

from palimpsa_jax import models

EMBEDDING_NAMES = {
    "transformers": "backbone.embeddings.weight",
    "mamba_ssm": "backbone.embedding.weight",
}
LAYER_PREFIX = "backbone.layers."
_LAYER_NAME = re.compile(r"^backbone\.layers\.(\d+)\.")
CONFIG_FILE = "config.json"


def safetensors_files(path: str) -> list[str]:
  """The .safetensors files of a checkpoint: `path` itself or all in a directory."""
  if os.path.isdir(path):
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
      raise FileNotFoundError(f"no *.safetensors file in directory {path!r}")
    return files
  if not os.path.isfile(path):
    raise FileNotFoundError(f"source {path!r} does not exist")
  if not path.endswith(".safetensors"):
    raise ValueError(f"source {path!r} must be a .safetensors file or a directory")
  return [path]


def read_tensors(path: str) -> dict[str, np.ndarray]:
  """All tensors of the checkpoint at `path` (file or sharded directory)."""
  tensors: dict[str, np.ndarray] = {}
  for file in safetensors_files(path):
    for name, value in load_file(file).items():
      if name in tensors:
        raise ValueError(f"tensor {name!r} appears in more than one file under {path!r}")
      tensors[name] = value
  return tensors


def read_hf_config(path: str) -> dict[str, Any]:
  """config.json beside the weights ({} when there is none)."""
  folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
  config_path = os.path.join(folder, CONFIG_FILE)
  if not os.path.exists(config_path):
    return {}
  with open(config_path) as f:
    return json.load(f)


def detect_layout(tensors: dict[str, np.ndarray]) -> str:
  """'transformers' or 'mamba_ssm', from the embedding's name."""
  found = [layout for layout, name in EMBEDDING_NAMES.items() if name in tensors]
  if len(found) != 1:
    raise ValueError(
        "cannot tell the checkpoint layout: expected exactly one of "
        f"{sorted(EMBEDDING_NAMES.values())}, found {found or 'neither'}")
  return found[0]


@dataclasses.dataclass(frozen=True)
class Mamba2Dims:
  """Sizes of a Mamba2 language model (inferred from its tensors)."""
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  head_dim: int
  d_inner: int
  state_dim: int
  num_groups: int
  conv_kernel: int
  norm_eps: float


def _ssm_setting(hf_config: dict[str, Any], *keys: str) -> Any:
  """A mixer setting from a transformers config or a mamba_ssm ssm_cfg."""
  ssm_cfg = hf_config.get("ssm_cfg") or {}
  for key in keys:
    if key in hf_config:
      return hf_config[key]
    if key in ssm_cfg:
      return ssm_cfg[key]
  return None


def _check_supported(hf_config: dict[str, Any]) -> None:
  """Raises ValueError for mixer options our Mamba2 layer does not implement."""
  limit = _ssm_setting(hf_config, "time_step_limit", "dt_limit")
  if limit is not None and (float(limit[0]) != 0.0 or not math.isinf(float(limit[1]))):
    raise ValueError(f"config.json dt limit {limit} is not supported (only (0, inf))")
  if _ssm_setting(hf_config, "norm_before_gate"):
    raise ValueError("config.json norm_before_gate=True is not supported (Mamba2 uses False)")
  layer = _ssm_setting(hf_config, "layer")
  if layer not in (None, "Mamba2"):
    raise ValueError(f"config.json ssm_cfg.layer={layer!r}: only Mamba2 checkpoints convert")


def infer_dims(tensors: dict[str, np.ndarray], hf_config: dict[str, Any],
               num_groups: int | None = None) -> Mamba2Dims:
  """Model sizes from tensor shapes (groups and state size split by config.json).

  The xBC channels hold 2 G Ns besides x; G comes from `num_groups`, else
  config.json (n_groups / ssm_cfg.ngroups), else 1 (the mamba_ssm default).
  """
  _check_supported(hf_config)
  vocab_size, d_model = tensors[EMBEDDING_NAMES[detect_layout(tensors)]].shape
  layers = sorted({int(m.group(1)) for name in tensors
                   if (m := _LAYER_NAME.match(name))})
  if not layers or layers != list(range(len(layers))):
    raise ValueError(f"layer indices must be 0..n-1, found {layers}")

  def layer0(suffix):
    name = f"{LAYER_PREFIX}0.mixer.{suffix}"
    if name not in tensors:
      raise ValueError(f"missing tensor {name!r}")
    return tensors[name]

  num_heads = layer0("A_log").shape[0]
  d_inner = layer0("out_proj.weight").shape[1]
  conv_channels, _, conv_kernel = layer0("conv1d.weight").shape
  if d_inner % num_heads:
    raise ValueError(f"inner width {d_inner} is not a multiple of the {num_heads} heads")
  group_state = conv_channels - d_inner  # 2 G Ns
  in_proj_rows = layer0("in_proj.weight").shape[0]
  if in_proj_rows != 2 * d_inner + group_state + num_heads:
    raise ValueError(
        f"in_proj has {in_proj_rows} outputs, expected 2*{d_inner} + {group_state} + "
        f"{num_heads}: checkpoints with a gated MLP part (d_ssm < d_inner) are not supported")
  if num_groups is None:
    num_groups = _ssm_setting(hf_config, "n_groups", "ngroups") or 1
  state_dim = _ssm_setting(hf_config, "state_size", "d_state")
  if group_state <= 0 or group_state % (2 * num_groups):
    raise ValueError(
        f"conv1d has {conv_channels} channels = inner width {d_inner} + 2 G Ns; "
        f"2 G Ns = {group_state} is not divisible by 2 * num_groups = {2 * num_groups}")
  if state_dim is not None and state_dim * 2 * num_groups != group_state:
    raise ValueError(
        f"config.json state size {state_dim} with {num_groups} groups does not match "
        f"2 G Ns = {group_state} from conv1d")
  if num_heads % num_groups:
    raise ValueError(f"num_groups {num_groups} must divide the {num_heads} heads")
  if d_inner % d_model:
    raise ValueError(f"inner width {d_inner} is not an integer multiple of d_model {d_model}")
  eps = hf_config.get("layer_norm_epsilon", hf_config.get("norm_epsilon", 1e-5))
  return Mamba2Dims(
      vocab_size=vocab_size, d_model=d_model, num_layers=len(layers),
      num_heads=num_heads, head_dim=d_inner // num_heads, d_inner=d_inner,
      state_dim=group_state // (2 * num_groups), num_groups=num_groups,
      conv_kernel=conv_kernel, norm_eps=float(eps))


def _linear(w: np.ndarray) -> np.ndarray:
  return w.T


def _conv(w: np.ndarray) -> np.ndarray:
  return w[:, 0, :].T  # [C, 1, W] -> [W, C]


def _same(w: np.ndarray) -> np.ndarray:
  return w


def tensor_table(dims: Mamba2Dims, layout: str) -> list[tuple[str, tuple, tuple, Any]]:
  """(HF name, HF shape, our parameter path, transform) for every weight."""
  d, di, h = dims.d_model, dims.d_inner, dims.num_heads
  xbc = di + 2 * dims.num_groups * dims.state_dim
  table = [
      (EMBEDDING_NAMES[layout], (dims.vocab_size, d), ("embed",), _same),
      ("backbone.norm_f.weight", (d,), ("final_norm", "scale"), _same),
  ]
  mixer_weights = (
      ("in_proj.weight", (di + xbc + h, d), ("in_proj", "kernel"), _linear),
      ("conv1d.weight", (xbc, 1, dims.conv_kernel), ("conv", "kernel"), _conv),
      ("conv1d.bias", (xbc,), ("conv", "bias"), _same),
      ("A_log", (h,), ("A_log",), _same),
      ("D", (h,), ("D",), _same),
      ("dt_bias", (h,), ("dt_bias",), _same),
      ("norm.weight", (di,), ("norm", "scale"), _same),
      ("out_proj.weight", (d, di), ("out_proj", "kernel"), _linear),
  )
  for layer in range(dims.num_layers):
    prefix = f"{LAYER_PREFIX}{layer}."
    table.append((prefix + "norm.weight", (d,), ("blocks", layer, "mixer_norm", "scale"),
                  _same))
    for suffix, shape, path, transform in mixer_weights:
      table.append((prefix + "mixer." + suffix, shape, ("blocks", layer, "mixer") + path,
                    transform))
  return table


def check_tensor_names(tensors: dict[str, np.ndarray], expected: set[str],
                       optional: set[str], label: str) -> None:
  """Raises ValueError naming every tensor not in expected | optional, and every missing one."""
  unmapped = sorted(set(tensors) - expected - optional)
  missing = sorted(expected - set(tensors))
  problems = []
  if unmapped:
    problems.append(f"unmapped tensors (no counterpart in our model): {unmapped}")
  if missing:
    problems.append(f"missing tensors: {missing}")
  if problems:
    raise ValueError(f"{label}: " + "; ".join(problems))


def _set(tree: dict, path: tuple, value: np.ndarray) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def map_tensors(tensors: dict[str, np.ndarray], dims: Mamba2Dims,
                layout: str) -> dict[str, Any]:
  """Our parameter tree (float32 numpy) from the HF tensors; strict.

  Raises:
    ValueError: naming every unmapped tensor, every missing tensor, or the
      first tensor with an unexpected shape; or when lm_head differs from the
      embedding (our models tie the output head to it).
  """
  table = tensor_table(dims, layout)
  check_tensor_names(tensors, {name for name, *_ in table}, {"lm_head.weight"},
                     f"{layout} Mamba2 checkpoint")
  params: dict[str, Any] = {}
  for name, shape, path, transform in table:
    value = tensors[name]
    if value.shape != shape:
      raise ValueError(f"tensor {name!r} has shape {value.shape}, expected {shape}")
    _set(params, path, np.ascontiguousarray(transform(np.asarray(value, np.float32))))
  if "lm_head.weight" in tensors:
    head = np.asarray(tensors["lm_head.weight"], np.float32)
    if head.shape != params["embed"].shape or not np.array_equal(head, params["embed"]):
      raise ValueError(
          "tensor 'lm_head.weight' differs from the embedding: untied output heads are "
          "not supported (our models tie the head to the embedding)")
  return params


def model_config(dims: Mamba2Dims, dtype: str = "float32",
                 beta_rank: int | None = None) -> ml_collections.ConfigDict:
  """Our Mamba2 model config for these sizes (beta_rank: ceil(d/16) by default)."""
  config = models.model_config(
      "mamba2", "tiny", vocab_size=dims.vocab_size, d_model=dims.d_model,
      num_layers=dims.num_layers, expand=dims.d_inner // dims.d_model,
      head_dim=dims.head_dim, state_dim=dims.state_dim, num_groups=dims.num_groups,
      conv_kernel=dims.conv_kernel, norm_eps=dims.norm_eps, dtype=dtype,
      beta_rank=beta_rank or math.ceil(dims.d_model / 16))
  config.size = "hf"
  return config


def load_hf_mamba2(path: str, *, num_groups: int | None = None, dtype: str = "float32"
                   ) -> tuple[dict[str, Any], ml_collections.ConfigDict, str]:
  """(parameter tree, model config, layout name) of a Hugging Face Mamba2 checkpoint."""
  tensors = read_tensors(path)
  layout = detect_layout(tensors)
  dims = infer_dims(tensors, read_hf_config(path), num_groups)
  return map_tensors(tensors, dims, layout), model_config(dims, dtype), layout
