"""MQAR evaluation of trained checkpoints on freshly generated test sets."""

from collections.abc import Mapping, Sequence
import functools
import math
from typing import Any

from flax import nnx
import jax
import ml_collections
import numpy as np

from palimpsa_jax import models
from palimpsa_jax.data import mqar as mqar_lib
from palimpsa_jax.data import pipeline
from palimpsa_jax.evaluation import checkpoints
from palimpsa_jax.evaluation import lm as lm_lib
from palimpsa_jax.evaluation import tables
from palimpsa_jax.training import objective as objective_lib
from palimpsa_jax.training import steps as steps_lib

DEFAULT_NUM_EXAMPLES = 3000
DEFAULT_BATCH_SIZE = 128
# Test sets are drawn from a seed stream disjoint from training (2 * seed) and
# the run's own validation set (2 * seed + 1).
_TEST_SEED_OFFSET = 1_000_003


def accuracy_on(model: nnx.Module, inputs: np.ndarray, targets: np.ndarray,
                batch_size: int) -> dict[str, float]:
  """Query accuracy and mean query cross-entropy of `model`, as the trainer evaluates them.

  The batches hold the query positions, as the trainer's MQAR test batches do
  (data/tasks.py), and each goes through the trainer's own evaluation sums
  (training.steps.eval_sums: the objective's metric sums of the model's token_losses at
  those positions).

  Args:
    model: NNX language model with token_losses (models.LanguageModel).
    inputs: [N, T] int32 MQAR inputs.
    targets: [N, T] int32 (IGNORE_INDEX where not a query).
    batch_size: examples per forward pass (the last batch is padded).
  """
  graphdef, params, model_state = models.split_model(model)
  sums = jax.jit(functools.partial(steps_lib.eval_sums, graphdef))
  padded = pipeline.pad_rows(
      {"tokens": inputs, "targets": targets,
       "positions": mqar_lib.target_positions(targets)}, batch_size,
      {"tokens": 0, "targets": mqar_lib.IGNORE_INDEX, "positions": 0})
  total = 0.0
  for start in range(0, len(padded["tokens"]), batch_size):
    total = total + sums(params, model_state,
                         {name: rows[start:start + batch_size] for name, rows in padded.items()})
  total = np.asarray(jax.device_get(total), np.float64)
  means = objective_lib.means(total)
  return {"accuracy": float(means["accuracy"]), "loss": float(means["loss"]),
          "num_queries": int(objective_lib.count(total))}


def parse_settings(text: str | Sequence[Any] | None) -> list[tuple[int, int]]:
  """"1024:256,2048:512" (or a list of pairs) -> [(seq_len, num_kv_pairs), ...].

  Raises:
    mqar_lib.SettingError: an item is not SEQ_LEN:NUM_KV_PAIRS, or no example of that length
      holds that many pairs (the model's vocabulary is checked when it is known).
  """
  if not text:
    return []
  if isinstance(text, str):
    items = [item for item in text.split(",") if item.strip()]
    pairs = []
    for item in items:
      parts = item.split(":")
      if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise mqar_lib.SettingError(
            f"--mqar_settings: {item!r} must look like SEQ_LEN:NUM_KV_PAIRS, e.g. 1024:256.")
      pairs.append((int(parts[0]), int(parts[1])))
  else:
    pairs = [(int(a), int(b)) for a, b in text]
  for seq_len, num_kv_pairs in pairs:
    try:
      mqar_lib.check_setting(seq_len, num_kv_pairs)
    except mqar_lib.SettingError as error:
      raise mqar_lib.SettingError(
          f"--mqar_settings: {seq_len}:{num_kv_pairs}: {error}") from None
  return pairs


def evaluate_checkpoint(checkpoint: str, settings: Sequence[tuple[int, int]],
                        num_examples: int, batch_size: int,
                        seed: int = 0) -> dict[str, Any]:
  """Evaluates one checkpoint on its trained setting and on `settings`.

  Returns:
    {"checkpoint", "step", "mixer", "results": [{"seq_len", "num_kv_pairs",
    "accuracy", "loss", "num_queries", "trained_setting"}, ...]}.
  """
  model, config, step = checkpoints.load_model(checkpoint)
  checkpoints.require_task(checkpoint, config, "mqar", "the mqar suite")
  data = config.data
  for seq_len, num_kv_pairs in settings:
    try:
      mqar_lib.check_setting(seq_len, num_kv_pairs, data.vocab_size)
    except mqar_lib.SettingError as error:
      raise mqar_lib.SettingError(
          f"--mqar_settings: {seq_len}:{num_kv_pairs} for {checkpoint}: {error}") from None
  trained = (config.seq_len, data.num_kv_pairs)
  results = []
  for index, (seq_len, num_kv_pairs) in enumerate(
      [trained] + [s for s in settings if s != trained]):
    inputs, targets = mqar_lib.multiquery_ar(
        vocab_size=data.vocab_size, num_examples=num_examples,
        input_seq_len=seq_len, num_kv_pairs=num_kv_pairs, power_a=data.power_a,
        random_non_queries=data.random_non_queries,
        seed=_TEST_SEED_OFFSET + 1000 * seed + index)
    metrics = accuracy_on(model, inputs, targets, batch_size)
    results.append({"seq_len": seq_len, "num_kv_pairs": num_kv_pairs,
                    "trained_setting": index == 0, **metrics})
  return {"checkpoint": checkpoint, "step": step, "mixer": mixer_name(config),
          "results": results}


def mixer_name(config: ml_collections.ConfigDict) -> str:
  """The run's mixer as a reader knows it: "mamba2", or for a converted model (metaplastic
  layers added to a Mamba2 / NotPalimpsa source) "mamba2+metaplastic[1]"."""
  name = config.get("args", {}).get("model") or config.model.get("model")
  layers = list(config.model.get("metaplastic_layers") or ())
  if layers:
    name += f"+metaplastic[{','.join(str(layer) for layer in layers)}]"
  return name


def format_table(evaluations: Sequence[Mapping[str, Any]]) -> str:
  """A plain-text table: one row per checkpoint and setting."""
  rows = []
  for evaluation in evaluations:
    for r in evaluation["results"]:
      loss = r["loss"] if math.isfinite(r["loss"]) else float("nan")
      rows.append([tables.shorten(evaluation["checkpoint"], 40), str(evaluation["step"]),
                   str(evaluation["mixer"]), str(r["seq_len"]), str(r["num_kv_pairs"]),
                   f"{100 * r['accuracy']:.2f}%", f"{loss:.4f}"])
  return tables.format_table(
      ["checkpoint", "step", "mixer", "seq_len", "kv", "accuracy", "loss"], rows,
      right=[False, True, False, True, True, True, True])


def run(options: Mapping[str, Any]) -> dict[str, Any]:
  """The "mqar" suite of eval.py.

  Options: "checkpoint" (list of workdirs or checkpoints/<step> folders),
  "mqar_settings" (extra "SEQ_LEN:KV,..." test settings), "num_examples"
  (default 3000), "batch_size" (default 128), "seed" (test-set seed).
  """
  checkpoints = lm_lib.checkpoints_option(options)
  settings = parse_settings(options.get("mqar_settings"))
  num_examples = lm_lib.int_option(options, "num_examples", DEFAULT_NUM_EXAMPLES)
  batch_size = lm_lib.int_option(options, "batch_size", DEFAULT_BATCH_SIZE)
  evaluations = [
      evaluate_checkpoint(c, settings, num_examples, batch_size,
                          int(options.get("seed") or 0))
      for c in checkpoints]
  print(format_table(evaluations), flush=True)
  return {"suite": "mqar", "num_examples": num_examples,
          "evaluations": evaluations}
