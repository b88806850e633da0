"""The conversion command: read a source, choose layers, convert, write dest."""

import os
from typing import Any

import numpy as np

from palimpsa_jax import models
from palimpsa_jax.conversion import checkpoint as checkpoint_lib
from palimpsa_jax.conversion import sources
from palimpsa_jax.conversion import surgery
from palimpsa_jax.conversion import windows as windows_lib
from palimpsa_jax.data import text as text_lib
from palimpsa_jax.data import tokenizer as tokenizer_lib


def calibration_batch(files: str, tokenizer_path: str, seq_len: int,
                      num_rows: int) -> np.ndarray:
  """[num_rows, seq_len] int32 tokens: the files' documents, concatenated (EOS between)."""
  tokenizer = tokenizer_lib.load_tokenizer(tokenizer_path)
  needed = seq_len * num_rows
  tokens: list[int] = []
  for document in text_lib.iter_documents(files):
    tokens.extend(tokenizer.encode(document))
    tokens.append(tokenizer.eos_id)
    if len(tokens) >= needed:
      break
  if len(tokens) < needed:
    raise ValueError(
        f"--calibration_files {files!r} hold {len(tokens)} tokens, fewer than "
        f"{num_rows} x {seq_len} = {needed}")
  return np.asarray(tokens[:needed], np.int32).reshape(num_rows, seq_len)


def default_tokenizer(source: str) -> str:
  """tokenizer.json beside a Hugging Face checkpoint, for calibration."""
  folder = source if os.path.isdir(source) else os.path.dirname(os.path.abspath(source))
  path = os.path.join(folder, "tokenizer.json")
  if not os.path.isfile(path):
    raise ValueError(
        f"--calibration_files needs --tokenizer (no tokenizer.json beside {source!r})")
  return path


def run_conversion(source: str, dest: str, layers: str, init: str = "paper", *,
                   seed: int = 0, calibration_tokens: np.ndarray | None = None,
                   num_groups: int | None = None, dtype: str | None = None,
                   verbose: bool = True) -> dict[str, Any]:
  """Converts `source` into `dest` and returns what was done.

  Args:
    source: train.py workdir (or checkpoints/<step>) or HF Mamba2 safetensors.
    dest: output directory (conversion.json + converted/).
    layers: "auto:N", "i,j,k" or "none" (an unconverted copy: the control).
    init: "paper" (to fine-tune) or "zero" (an equivalence check: computes the
      source function exactly and cannot be fine-tuned; see surgery.py).
    seed: initialisation seed of the new parameters.
    calibration_tokens: [B, T] tokens on which dt is measured; None: dt from dt_bias.
    num_groups: B/C groups of an HF checkpoint without them in config.json.
    dtype: compute dtype of the converted model (None: keep / float32 for HF).
    verbose: print the window table.

  Returns:
    {"layers": chosen layers, "windows": [L, H] list, "dt_source", "source_kind"}.
  """
  checkpoint_lib.check_dest_free(dest)
  src = sources.load_source(source, num_groups=num_groups, dtype=dtype)
  if calibration_tokens is None:
    dt = windows_lib.bias_dt(src.params, src.config.num_layers)
    dt_source = "softplus(dt_bias)"
  else:
    model, _ = surgery.convert(src, [], seed=seed)
    dt = windows_lib.measured_dt(model, calibration_tokens)
    dt_source = f"calibration batch {list(calibration_tokens.shape)}"
  windows = windows_lib.layer_windows(src.params, dt)
  choice = windows_lib.parse_layers(layers)
  chosen = list(choice.layers)
  if choice.count is not None:
    chosen = windows_lib.choose_layers(windows, choice.count,
                                       exclude=models.metaplastic_layers(src.config))
  model, config = surgery.convert(src, chosen, init, seed)
  if verbose:
    print(windows_lib.window_table(windows, chosen, dt_source), flush=True)
  info = {"source": os.path.abspath(source), "source_kind": src.kind,
          "source_step": src.step, "layers": sorted(chosen), "init": init,
          "seed": seed, "windows": windows.tolist(), "dt_source": dt_source}
  checkpoint_lib.write_conversion(dest, model, config, info)
  if verbose:
    print(f"converted layers {sorted(chosen)} ({init} init) of {src.kind} source "
          f"{source} -> {dest}", flush=True)
  return info
