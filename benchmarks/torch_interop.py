"""Logits of the authors' PyTorch models against ours, both directions, on one GPU.

  python3 -m benchmarks.torch_interop --out $OUT/torch_interop.json

Needs torch, transformers 5, flash-linear-attention + fla-core 0.6.0 and the
authors' `palimpsa` package importable (see docs/torch_models.md for the
install line). For Palimpsa-D 170M and MetaMamba2 170M, randomly initialised:
  ours -> theirs: our model exported with torch_checkpoints.export_checkpoint and
    loaded with the authors' from_pretrained;
  theirs -> ours: the authors' model (their own init) saved with
    save_pretrained and read with torch_checkpoints.import_checkpoint.
Each pair's logits on the same tokens are compared in float32 (their
fused_recurrent kernels, no TF32; our matmuls at "highest" precision) and in
bfloat16 (their chunk kernels on bf16 weights; our bf16 compute on float32
parameters): rel = ||ours - theirs|| / ||theirs|| over all logits, against
1e-4 (float32) and 1e-2 (bfloat16). Each side's own bfloat16-vs-float32 rel is
recorded too (`*_bfloat16_vs_float32`): at random initialisation it can exceed
1e-2 by itself. Results go to --out as JSON, and the table of relative errors as
a record to --records (benchmarks/records/, rendered into docs/results/interop.md).

The authors' code was written for older FLA and transformers releases; the
few names that moved are aliased before it is imported (`compat` in the JSON
lists what was patched).
"""

import argparse
import contextlib
import importlib
import importlib.machinery
import inspect
import json
import os
import sys
import tempfile
import time
import traceback
import types

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import numpy as np  # pylint: disable=g-import-not-at-top

from benchmarks import results as results_lib

THRESHOLDS = {"float32": 1e-4, "bfloat16": 1e-2}
DIRECTIONS = {"ours_to_theirs": "ours -> theirs", "theirs_to_ours": "theirs -> ours"}


def authors_compat() -> list[str]:
  """Aliases the FLA / transformers / wandb names the authors' code imports; what was done."""
  done = []
  # transformers imports accelerate, which asks once whether wandb is installed
  # (importlib.util.find_spec): let it see the truth before the stub exists.
  importlib.import_module("transformers.activations")
  try:
    importlib.import_module("wandb")
  except ImportError:
    stub = types.ModuleType("wandb")
    stub.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    stub.run = None  # their diagnostics run only when a wandb run is active
    sys.modules["wandb"] = stub
    done.append("wandb: stub module (run=None)")
  for old, new in (("fla.modules.layernorm_gated", "fla.modules.norm.layernorm_gated"),
                   ("fla.modules.l2norm", "fla.modules.norm.l2norm")):
    try:
      importlib.import_module(old)
    except ImportError:
      sys.modules[old] = importlib.import_module(new)
      done.append(f"{old} -> {new}")
  import fla.utils  # pylint: disable=g-import-not-at-top
  if not hasattr(fla.utils, "use_cuda_graph"):
    fla.utils.use_cuda_graph = False
    done.append("fla.utils.use_cuda_graph = False")
  import triton  # pylint: disable=g-import-not-at-top
  if "use_cuda_graph" not in inspect.signature(triton.autotune).parameters:
    autotune = triton.autotune

    def autotune_without_cuda_graph(*args, use_cuda_graph=None, **kwargs):
      del use_cuda_graph
      return autotune(*args, **kwargs)

    triton.autotune = autotune_without_cuda_graph
    done.append("triton.autotune: use_cuda_graph dropped")
  # pylint: disable=g-import-not-at-top
  from palimpsa.models.meta_mamba2 import MetaMamba2ForCausalLM
  from palimpsa.models.palimpsa import PalimpsaForCausalLM
  # pylint: enable=g-import-not-at-top
  for cls, prefix in ((PalimpsaForCausalLM, "model"), (MetaMamba2ForCausalLM, "backbone")):
    if not isinstance(cls._tied_weights_keys, dict):  # transformers 5 wants {target: source}
      cls._tied_weights_keys = {"lm_head.weight": f"{prefix}.embeddings.weight"}
      done.append(f"{cls.__name__}._tied_weights_keys as a dict")
  return done


def authors_classes(model_type: str):
  # pylint: disable=g-import-not-at-top
  if model_type == "palimpsa":
    from palimpsa.models.palimpsa import PalimpsaConfig, PalimpsaForCausalLM
    return PalimpsaConfig, PalimpsaForCausalLM
  from palimpsa.models.meta_mamba2 import MetaMamba2Config, MetaMamba2ForCausalLM
  return MetaMamba2Config, MetaMamba2ForCausalLM


def model_labels() -> dict[str, str]:
  """The authors' model types (conversion/torch_layouts.py) -> our 170M model's label."""
  # pylint: disable=g-import-not-at-top
  from palimpsa_jax.conversion import torch_layouts
  from palimpsa_jax.models import registry
  # pylint: enable=g-import-not-at-top
  return {model_type: f"{registry.label(torch_layouts.our_mixer(model_type, True))} 170M"
          for model_type in torch_layouts.MODEL_TYPES}


def our_170m(model_type: str):
  """Our 170M model config in the authors' architecture (no beta bias, one norm group)."""
  # pylint: disable=g-import-not-at-top
  from palimpsa_jax import models
  from palimpsa_jax.conversion import torch_layouts
  # pylint: enable=g-import-not-at-top
  mixer = torch_layouts.our_mixer(model_type, True)
  if model_type == "palimpsa":
    return models.model_config(mixer, "170m", beta_bias=False, dtype="float32")
  return models.model_config(mixer, "170m", beta_bias=False, norm_groups=1, dtype="float32")


def their_logits(model, tokens: np.ndarray, dtype: str) -> np.ndarray:
  """Logits [B, T, V] float32 of the authors' model (float32: fused_recurrent kernels)."""
  import torch  # pylint: disable=g-import-not-at-top
  torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
  model = model.to(device="cuda", dtype=torch_dtype).eval()
  for layer in model.get_decoder().layers:
    mixer = layer.attn if hasattr(layer, "attn") else layer.mixer
    mixer.mode = "fused_recurrent" if dtype == "float32" else "chunk"
  with torch.no_grad():
    logits = model(input_ids=torch.as_tensor(tokens, device="cuda").long(), use_cache=False).logits
  return logits.float().cpu().numpy()


class OurForward:
  """Our logits for a parameter tree, one compiled function per (config, dtype)."""

  def __init__(self, config, dtype: str):
    # pylint: disable=g-import-not-at-top
    from flax import nnx
    import jax
    from palimpsa_jax import models
    # pylint: enable=g-import-not-at-top
    config = config.copy_and_resolve_references()
    config.dtype = dtype
    graphdef = models.abstract_model(lambda rngs: models.build_model(config, rngs)).graphdef
    self._forward = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))
    self._precision = "highest" if dtype == "float32" else None

  def __call__(self, params, tokens: np.ndarray) -> np.ndarray:
    import jax  # pylint: disable=g-import-not-at-top
    scope = (jax.default_matmul_precision(self._precision) if self._precision
             else contextlib.nullcontext())
    with scope:
      return np.asarray(self._forward(params, jax.numpy.asarray(tokens)))


def compare(ours: np.ndarray, theirs: np.ndarray, dtype: str) -> dict:
  diff = ours.astype(np.float64) - theirs.astype(np.float64)
  rel = float(np.linalg.norm(diff) / np.linalg.norm(theirs.astype(np.float64)))
  return {"rel_err": rel, "max_abs_err": float(np.abs(diff).max()),
          "max_abs_logit": float(np.abs(theirs).max()), "threshold": THRESHOLDS[dtype],
          "ok": bool(rel <= THRESHOLDS[dtype])}


def run_model_type(model_type: str, tokens: np.ndarray, workdir: str, log) -> dict:
  """Both directions for one model type; returns the comparisons and timings."""
  # pylint: disable=g-import-not-at-top
  from flax import nnx
  import jax
  import torch
  from palimpsa_jax import models
  from palimpsa_jax.conversion import checkpoint as checkpoint_lib
  from palimpsa_jax.conversion import torch_layouts
  from palimpsa_jax.conversion import torch_checkpoints
  # pylint: enable=g-import-not-at-top
  config_cls, model_cls = authors_classes(model_type)
  config = our_170m(model_type)
  result = {"config": {k: config[k] for k in ("model", "num_layers", "d_model")}, "timings_s": {}}
  start = time.time()

  def mark(name):
    result["timings_s"][name] = round(time.time() - start, 1)
    log(f"{model_type}: {name} at {result['timings_s'][name]} s")

  # ours -> theirs
  with jax.default_device(jax.devices("cpu")[0]):
    model = models.build_model(config, nnx.Rngs(0))
  folder = lambda name: os.path.join(workdir, f"{model_type}_{name}")
  ours_dir, hf_dir = folder("ours"), folder("hf")
  checkpoint_lib.write_conversion(ours_dir, model, config, {"init": "paper"})
  torch_checkpoints.export_checkpoint(ours_dir, hf_dir, verbose=False)
  theirs = model_cls.from_pretrained(hf_dir, dtype=torch.float32)
  result["num_params"] = sum(p.numel() for p in theirs.parameters())
  mark("exported and loaded in theirs")
  _, our_params, _ = models.split_model(checkpoint_lib.load_converted(ours_dir)[0])
  # theirs -> ours
  torch.manual_seed(0)
  hf_config = torch_layouts.authors_config(config)
  hf_config.pop("model_type")
  native = model_cls(config_cls(**hf_config))
  native.lm_head.weight = native.get_input_embeddings().weight  # tied, as from_pretrained ties
  native_dir, imported = folder("native"), folder("imported")
  native.save_pretrained(native_dir)
  torch_checkpoints.import_checkpoint(native_dir, imported, verbose=False)
  _, imported_params, _ = models.split_model(checkpoint_lib.load_converted(imported)[0])
  mark("theirs saved and imported")
  forwards = {dtype: OurForward(config, dtype) for dtype in THRESHOLDS}
  for direction, params, torch_model in (("ours_to_theirs", our_params, theirs),
                                         ("theirs_to_ours", imported_params, native)):
    logits = {dtype: (forwards[dtype](params, tokens), their_logits(torch_model, tokens, dtype))
              for dtype in THRESHOLDS}  # float32 first: their_logits casts the model
    for dtype, (ours, their) in logits.items():
      result[f"{direction}_{dtype}"] = compare(ours, their, dtype)
      mark(f"{direction} {dtype}: rel {result[f'{direction}_{dtype}']['rel_err']:.2e}")
    # What bfloat16 alone changes on each side: the floor under the bfloat16 comparison.
    result[f"{direction}_bfloat16_vs_float32"] = {
        side: compare(logits["bfloat16"][i], logits["float32"][i], "bfloat16")["rel_err"]
        for i, side in enumerate(("ours", "theirs"))}
  del theirs, native
  torch.cuda.empty_cache()
  return result


def error_table(result: dict) -> str:
  """Markdown: per model and direction, the logits' relative errors (models that finished)."""
  lines = ["| model | direction | float32 rel (threshold 1e-4) | bfloat16 rel (threshold 1e-2) "
           "| bfloat16 vs float32: ours / theirs |", "|---|---|---|---|---|"]
  for model, label in model_labels().items():
    for direction, arrow in DIRECTIONS.items():
      if f"{direction}_bfloat16_vs_float32" not in result.get(model, {}):
        continue
      errors = [result[model][f"{direction}_{dtype}"] for dtype in THRESHOLDS]
      cells = [f"{e['rel_err']:.2e}" + ("" if e["ok"] else " (over)") for e in errors]
      floor = result[model][f"{direction}_bfloat16_vs_float32"]
      lines.append(f"| {label} | {arrow} | {' | '.join(cells)} "
                   f"| {floor['ours']:.2e} / {floor['theirs']:.2e} |")
  return "\n".join(lines)


def write_record(result: dict, args: argparse.Namespace, log) -> None:
  """The run's record: error_table, parameter counts, what was aliased (none when no model
  finished)."""
  table = error_table(result)
  if table.count("\n") < 2:
    log("no model finished: no record")
    return
  notes = [f"{label}: failed ({result[model]['error'].strip().splitlines()[-1]})"
           if "error" in result[model] else f"{label}: {result[model]['num_params']:,} parameters"
           for model, label in model_labels().items()]
  notes.append(f"aliased for the authors' code: {', '.join(result['compat']) or 'nothing'}")
  record = results_lib.make_record(
      "torch_interop", "torch_interop (the authors' PyTorch models against ours)",
      results_lib.command_line("benchmarks.torch_interop", sys.argv[1:], python="python3"),
      settings={"batch": args.batch, "seq_len": args.seq_len}, table=table,
      versions={"torch": result["torch"], "transformers": result["transformers"],
                "fla": result["fla"]},
      notes=notes)
  log(f"wrote {results_lib.write_record(record, args.records)}")


def main():
  parser = argparse.ArgumentParser(prog=__spec__.name, description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True, help="JSON file to write")
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--seq_len", type=int, default=256)
  results_lib.add_record_flags(parser)
  args = parser.parse_args()
  import torch  # pylint: disable=g-import-not-at-top
  torch.backends.cuda.matmul.allow_tf32 = False
  torch.backends.cudnn.allow_tf32 = False
  record = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "batch": args.batch, "seq_len": args.seq_len}

  def log(message):
    print(message, flush=True)

  def save():
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(record, f, indent=2)

  try:
    record["compat"] = authors_compat()
    import fla  # pylint: disable=g-import-not-at-top
    import jax  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    record.update(fla=fla.__version__, transformers=transformers.__version__,
                  jax=jax.__version__, jax_devices=str(jax.devices()))
  except Exception:  # pylint: disable=broad-except
    record["error"] = traceback.format_exc()
    save()
    raise
  tokens = np.random.default_rng(0).integers(0, 32000, (args.batch, args.seq_len)).astype(np.int32)
  with tempfile.TemporaryDirectory() as workdir:
    for model_type in model_labels():
      try:
        record[model_type] = run_model_type(model_type, tokens, workdir, log)
      except Exception:  # pylint: disable=broad-except
        record[model_type] = {"error": traceback.format_exc()}
        log(record[model_type]["error"])
      save()
  checks = [v["ok"] for m in model_labels() for k, v in record[m].items()
            if isinstance(v, dict) and "ok" in v]
  record["all_ok"] = bool(checks) and all(checks) and len(checks) == 8
  save()
  errors = {m: {k: v["rel_err"] for k, v in record[m].items()
                if isinstance(v, dict) and "rel_err" in v} for m in model_labels()}
  log(json.dumps(errors))
  log(f"all_ok: {record['all_ok']}")
  if not args.no_record:
    write_record(record, args, log)


if __name__ == "__main__":
  main()
