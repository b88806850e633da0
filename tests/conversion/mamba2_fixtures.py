"""Tiny Mamba2 models, synthetic Hugging Face checkpoints and a NumPy Mamba2 reference.

The reference follows the Hugging Face / mamba_ssm definition directly on the
checkpoint's tensors (torch layouts), independently of our layers, so it checks
every transpose and split of the name mapping.
"""

import json
import os

from flax import nnx
import ml_collections
import numpy as np

from palimpsa_jax import models
from palimpsa_jax.conversion import hf_mamba2

NUM_LAYERS = 3
NUM_GROUPS = 2
STATE_DIM = 4


def tiny_config(model: str = "mamba2") -> ml_collections.ConfigDict:
  """3 layers, d 16, 4 heads of 8, G 2, Ns 4, vocab 32, float32."""
  if model == "mamba2":
    return models.model_config(
        "mamba2", "tiny", num_layers=NUM_LAYERS, d_model=16, head_dim=8,
        num_groups=NUM_GROUPS, state_dim=STATE_DIM, beta_rank=2, vocab_size=32,
        dtype="float32", implementation="sequential")
  return models.model_config(
      "not_palimpsa", "tiny", num_layers=2, d_model=16, num_heads=2, head_k_dim=8,
      head_v_dim=8, beta_rank=2, vocab_size=32, mlp_hidden_dim=32, dtype="float32",
      implementation="sequential")


def random_params(config: ml_collections.ConfigDict, seed: int) -> dict:
  """The model's parameters with every leaf randomised (A and dt kept sensible)."""
  _, params, _ = models.split_model(models.build_model(config, nnx.Rngs(seed)))
  rng = np.random.default_rng(seed)

  def randomise(path, leaf):
    name = str(path[-1].key)
    if name == "A_log":
      return np.log(rng.uniform(0.05, 2.0, leaf.shape)).astype(np.float32)
    if name == "dt_bias":
      return rng.uniform(-4.0, 0.0, leaf.shape).astype(np.float32)
    return (np.asarray(leaf) + 0.2 * rng.standard_normal(leaf.shape)).astype(np.float32)

  import jax  # pylint: disable=g-import-not-at-top
  return jax.tree_util.tree_map_with_path(randomise, params)


def to_hf_tensors(params: dict, config: ml_collections.ConfigDict, layout: str,
                  dtype=np.float32) -> dict[str, np.ndarray]:
  """Our Mamba2 parameters written under the Hugging Face names (torch layouts)."""
  tensors = {hf_mamba2.EMBEDDING_NAMES[layout]: params["embed"],
             "backbone.norm_f.weight": params["final_norm"]["scale"],
             "lm_head.weight": params["embed"]}
  for i in range(config.num_layers):
    block = params["blocks"][i]
    mixer = block["mixer"]
    prefix = f"backbone.layers.{i}."
    tensors.update({
        prefix + "norm.weight": block["mixer_norm"]["scale"],
        prefix + "mixer.in_proj.weight": np.asarray(mixer["in_proj"]["kernel"]).T,
        prefix + "mixer.conv1d.weight": np.asarray(mixer["conv"]["kernel"]).T[:, None, :],
        prefix + "mixer.conv1d.bias": mixer["conv"]["bias"],
        prefix + "mixer.A_log": mixer["A_log"],
        prefix + "mixer.D": mixer["D"],
        prefix + "mixer.dt_bias": mixer["dt_bias"],
        prefix + "mixer.norm.weight": mixer["norm"]["scale"],
        prefix + "mixer.out_proj.weight": np.asarray(mixer["out_proj"]["kernel"]).T,
    })
  return {k: np.ascontiguousarray(np.asarray(v, dtype)) for k, v in tensors.items()}


def write_hf_checkpoint(folder: str, tensors: dict[str, np.ndarray],
                        hf_config: dict | None = None, shards: int = 1) -> str:
  """Writes model(-0000k-of-0000n).safetensors (+ config.json) into `folder`."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  os.makedirs(folder, exist_ok=True)
  names = sorted(tensors)
  for k in range(shards):
    part = {n: tensors[n] for n in names[k::shards]}
    file = "model.safetensors" if shards == 1 else f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
    save_file(part, os.path.join(folder, file))
  if hf_config is not None:
    with open(os.path.join(folder, "config.json"), "w") as f:
      json.dump(hf_config, f)
  return folder


def write_workdir(workdir: str, config: ml_collections.ConfigDict, params: dict,
                  run_config: ml_collections.ConfigDict | None = None) -> None:
  """A train.py workdir holding `params` at step 7 (no optimizer state).

  run_config: the rest of the run's config.json (its model is `config`).
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from palimpsa_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  from palimpsa_jax.training import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top
  full = ml_collections.ConfigDict(run_config or {"seed": 0})
  full.model = config
  checkpoint_lib.save_config(full, workdir)
  checkpointer = checkpoint_lib.Checkpointer(workdir, every_steps=1, keep=1, async_save=False)
  data = iter(pipeline.array_dataset({"x": np.zeros((4, 1))}, batch_size=2, seed=0))
  checkpointer.save(7, {"step": jnp.asarray(7), "params": params, "model_state": {},
                        "opt_state": {}}, data, force=True)
  checkpointer.close()


def _rms(x, eps=1e-5):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _silu(x):
  return x / (1.0 + np.exp(-x))


def reference_logits(tensors: dict[str, np.ndarray], layout: str, tokens: np.ndarray,
                     num_groups: int, state_dim: int) -> np.ndarray:
  """Mamba2 LM forward in float64 on Hugging Face tensors; tokens [B, T] -> [B, T, V]."""
  t = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
  h = t[hf_mamba2.EMBEDDING_NAMES[layout]][tokens]
  batch, length, _ = h.shape
  layer = 0
  while f"backbone.layers.{layer}.norm.weight" in t:
    p = lambda name: t[f"backbone.layers.{layer}.{name}"]  # pylint: disable=cell-var-from-loop
    heads = p("mixer.A_log").shape[0]
    d_inner = p("mixer.out_proj.weight").shape[1]
    head_dim = d_inner // heads
    x = _rms(h) * p("norm.weight")
    proj = x @ p("mixer.in_proj.weight").T
    z, xbc, dt = np.split(proj, [d_inner, proj.shape[-1] - heads], axis=-1)
    weight = p("mixer.conv1d.weight")[:, 0, :]  # [C, W]
    width = weight.shape[1]
    padded = np.concatenate([np.zeros((batch, width - 1, xbc.shape[-1])), xbc], axis=1)
    conv = sum(padded[:, i:i + length] * weight[:, i] for i in range(width))
    xbc = _silu(conv + p("mixer.conv1d.bias"))
    xs, b, c = np.split(xbc, [d_inner, d_inner + num_groups * state_dim], axis=-1)
    xs = xs.reshape(batch, length, heads, head_dim)
    group = np.arange(heads) // (heads // num_groups)
    b = b.reshape(batch, length, num_groups, state_dim)[:, :, group]
    c = c.reshape(batch, length, num_groups, state_dim)[:, :, group]
    dt = np.logaddexp(dt + p("mixer.dt_bias"), 0.0)
    decay = np.exp(-np.exp(p("mixer.A_log")) * dt)  # [B, T, H]
    state = np.zeros((batch, heads, head_dim, state_dim))
    ys = []
    for step in range(length):
      state = (decay[:, step, :, None, None] * state
               + np.einsum("bh,bhp,bhn->bhpn", dt[:, step], xs[:, step], b[:, step]))
      ys.append(np.einsum("bhpn,bhn->bhp", state, c[:, step]))
    y = np.stack(ys, axis=1) + p("mixer.D")[:, None] * xs
    y = y.reshape(batch, length, d_inner) * _silu(z)
    y = y.reshape(batch, length, num_groups, d_inner // num_groups)
    y = _rms(y).reshape(batch, length, d_inner) * p("mixer.norm.weight")
    h = h + y @ p("mixer.out_proj.weight").T
    layer += 1
  h = _rms(h) * t["backbone.norm_f.weight"]
  return h @ t[hf_mamba2.EMBEDDING_NAMES[layout]].T
