"""Language-model suite: perplexity and bits per byte on held-out text, packed as in training.

Also holds what the long-context and commonsense suites share: a jitted next-token scorer for an
NNX language model, and loading a checkpoint together with its tokenizer.

  python eval.py --suite lm --checkpoint WORKDIR --files 'heldout/*.jsonl' [--max_length T]
      [--mesh_sequence N]   # each row split over N devices (context parallelism)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
import contextlib
import math
from typing import Any

from flax import nnx
import jax
import ml_collections
import numpy as np

from palimpsa_jax import user_errors
from palimpsa_jax.conversion import checkpoint as conversion_lib
from palimpsa_jax.data import text as text_lib
from palimpsa_jax.data import tokenizer as tokenizer_lib
from palimpsa_jax.evaluation import checkpoints
from palimpsa_jax.evaluation import suites
from palimpsa_jax.evaluation import tables
from palimpsa_jax.ops.token_loss import logits_token_loss
from palimpsa_jax.training import objective as objective_lib
from palimpsa_jax.training import sharding as sharding_lib

DEFAULT_BATCH_SIZE = 8


class OptionError(ValueError, user_errors.UserError):
  """An eval.py / generate.py option that is missing, out of range, or names a checkpoint of
  another task."""


class ModelScorer:
  """Log-probabilities of given next tokens under an NNX language model, jitted.

  The model is called as model(tokens [B, T], segment_ids=[B, T]) -> logits [B, T, vocab] f32.
  One compilation per input shape: callers pad to a few fixed shapes. With
  sequence_devices = N > 1, every row is split over the first N devices (context
  parallelism: a row may be N times longer than one device holds); T must be a multiple of N.
  """

  def __init__(self, model: nnx.Module, sequence_devices: int = 1):
    model.eval()
    self._graphdef, self._state = nnx.split(model)
    self._context = contextlib.nullcontext
    self._placement = None
    if sequence_devices > 1:
      if sequence_devices > jax.device_count():
        raise ValueError(f"sequence_devices={sequence_devices} but only "
                         f"{jax.device_count()} devices are available")
      # The training mesh with only its sequence axis above 1: rows split over it.
      self._placement = sharding_lib.mesh_context(
          ml_collections.ConfigDict({"sequence": sequence_devices}),
          jax.devices()[:sequence_devices])
      self._context = self._placement.kernel_context
      self._state = jax.device_put(self._state, sharding_lib.replicated(self._placement.mesh))
    self._score = jax.jit(self._score_impl)

  def _score_impl(self, state, tokens, segment_ids, targets):
    with self._context():  # entered while jit traces
      return self._score_logits(state, tokens, segment_ids, targets)

  def _score_logits(self, state, tokens, segment_ids, targets):
    model = nnx.merge(self._graphdef, state)
    metrics = objective_lib.position_metrics(
        logits_token_loss(model(tokens, segment_ids=segment_ids), targets))
    return -metrics["loss"], metrics["accuracy"] == 1

  def __call__(self, tokens: np.ndarray, segment_ids: np.ndarray,
               targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Returns log p(targets[b, t] | tokens[b, :t + 1]) [B, T] f32 and whether each target is
    the argmax [B, T] bool."""
    rows_sharding = None
    if self._placement is not None:
      devices = self._placement.mesh.size
      if tokens.shape[1] % devices:
        raise ValueError(
            f"rows of {tokens.shape[1]} tokens cannot be split over {devices} devices "
            "(mesh_sequence): use a row length (max_length) that is a multiple of it")
      rows_sharding = sharding_lib.batch_sharding(self._placement.mesh, tokens.shape,
                                                  self._placement.rules)
    rows = [jax.device_put(np.asarray(x, np.int32), rows_sharding)
            for x in (tokens, segment_ids, targets)]
    picked, greedy = self._score(self._state, *rows)
    return np.asarray(picked), np.asarray(greedy)


def lm_metrics(scorer: ModelScorer, batches: Iterable[Mapping[str, np.ndarray]],
               token_bytes: np.ndarray) -> dict[str, float]:
  """Perplexity and bits per byte over packed batches.

  Args:
    scorer: the model's scorer.
    batches: {"tokens", "segment_ids", "mask"} each [b, T] (make_text_eval_dataset).
    token_bytes: [vocab] UTF-8 bytes of each token (0 for special tokens).

  Returns:
    "perplexity" = exp(mean NLL per scored token), "bits_per_byte" = total NLL / ln 2 / bytes of
    the scored tokens, "nll_per_token", "tokens", "bytes". A token is scored when it follows a
    token of its own segment (the first token of each row segment has no context in the row).
  """
  nll = 0.0
  tokens_scored = 0.0
  bytes_scored = 0.0
  for batch in batches:
    targets, weights = text_lib.next_token_targets(batch["tokens"], batch["segment_ids"],
                                                   batch.get("mask"))
    log_probs, _ = scorer(batch["tokens"], batch["segment_ids"], targets)
    weights = weights.astype(np.float64)
    nll -= float(np.sum(log_probs.astype(np.float64) * weights))
    tokens_scored += float(weights.sum())
    bytes_scored += float(np.sum(token_bytes[targets] * weights))
  if tokens_scored == 0:
    raise ValueError("no token to score: the held-out files are empty or shorter than 2 tokens")
  return {
      "perplexity": math.exp(nll / tokens_scored),
      "bits_per_byte": nll / math.log(2) / max(bytes_scored, 1.0),
      "nll_per_token": nll / tokens_scored,
      "tokens": int(tokens_scored),
      "bytes": int(bytes_scored),
  }


def checkpoint_tokenizer(folder: str, config: Any) -> tokenizer_lib.TextTokenizer:
  """The tokenizer a run was trained with (config.data.tokenizer); a "bpe:<n>" one is looked
  for in `folder` and its parents (the workdir)."""
  return tokenizer_lib.load_tokenizer(
      tokenizer_lib.find_tokenizer_file(config.data.tokenizer, folder))


def load_checkpoint(checkpoint: str):
  """(model, config, step, tokenizer) of a train.py checkpoint or a conversion output
  (palimpsa_jax.evaluation.checkpoints)."""
  model, config, step = checkpoints.load_model(checkpoint)
  checkpoints.require_task(checkpoint, config, "lm", "a language model's evaluation or "
                           "sampling")
  return model, config, step, checkpoint_tokenizer(conversion_lib.tokenizer_folder(checkpoint),
                                                   config)


def checkpoints_option(options: Mapping[str, Any]) -> list[str]:
  """options["checkpoint"] as a non-empty list of paths."""
  value = options.get("checkpoint")
  if isinstance(value, str):
    value = [c for c in value.split(",") if c]
  if not value:
    raise OptionError("options['checkpoint'] must name at least one checkpoint (--checkpoint)")
  return list(value)


def int_option(options: Mapping[str, Any], key: str, default: int | None) -> int | None:
  """options[key] if given, else `default`; OptionError unless suites.OPTION_FIELDS[key]
  accepts it."""
  value = options.get(key)
  if value is None:
    return default
  field = suites.OPTION_FIELDS[key]
  if not field.accepts(value):
    raise OptionError(f"options[{key!r}] must be {field.expected}, got {value!r}")
  return value


def heldout_files(options: Mapping[str, Any], suite: str) -> str:
  """options["files"], a glob of held-out files of which one at least holds text."""
  files = options.get("files")
  if not files:
    raise OptionError(f"the {suite} suite needs held-out text files: options['files'] "
                      "(--files GLOB)")
  text_lib.require_text(files, "--files")
  return files


def evaluate_checkpoint(checkpoint: str, files: str | Sequence[str], seq_len: int | None,
                        batch_size: int, sequence_devices: int = 1) -> dict[str, Any]:
  """lm metrics of one checkpoint on the held-out files (seq_len defaults to the training one).

  sequence_devices: split every row over this many devices (ModelScorer).
  """
  model, config, step, tokenizer = load_checkpoint(checkpoint)
  seq_len = seq_len or int(config.seq_len)
  batches = text_lib.make_text_eval_dataset(files, tokenizer, seq_len, batch_size)
  metrics = lm_metrics(ModelScorer(model, sequence_devices), batches, tokenizer.token_bytes)
  return {**metrics, "step": int(step), "seq_len": seq_len}


def format_table(results: Mapping[str, Mapping[str, Any]]) -> str:
  """One row per checkpoint; a note below when they were scored at different context lengths
  (each checkpoint's own seq_len, unless --max_length set one)."""
  rows = [[tables.shorten(checkpoint, 40), str(r["step"]), str(r["seq_len"]), f"{r['tokens']:,}",
           f"{r['perplexity']:.4f}", f"{r['bits_per_byte']:.4f}"]
          for checkpoint, r in results.items()]
  table = tables.format_table(
      ["checkpoint", "step", "seq_len", "tokens", "perplexity", "bits/byte"], rows,
      right=[False, True, True, True, True, True])
  if len({r["seq_len"] for r in results.values()}) > 1:
    table += ("\nnote: these checkpoints were scored at different context lengths (seq_len, "
              "each its run's own); --max_length scores them all at one.")
  return table


def run(options: Mapping[str, Any]) -> dict[str, Any]:
  """eval.py --suite lm.

  Options: "checkpoint" (list), "files" (glob of held-out files), "max_length" (row length,
  default: each run's seq_len), "batch_size", "mesh_sequence" (devices each row is split over).

  Returns:
    {"checkpoints": {path: {"perplexity", "bits_per_byte", "nll_per_token", "tokens",
    "bytes", "step", "seq_len"}}, "files"}, for one checkpoint as for several.
  """
  files = heldout_files(options, "lm")
  checkpoints = checkpoints_option(options)
  seq_len = int_option(options, "max_length", None)
  batch_size = int_option(options, "batch_size", DEFAULT_BATCH_SIZE)
  sequence_devices = int_option(options, "mesh_sequence", 1)
  results = {checkpoint: evaluate_checkpoint(checkpoint, files, seq_len, batch_size,
                                             sequence_devices)
             for checkpoint in checkpoints}
  print(format_table(results), flush=True)
  return {"checkpoints": results, "files": files}
