"""lm-evaluation-harness adapter for our JAX language models, and the commonsense suite.

Importing this module registers the lm-eval model "palimpsa_jax" (needs `pip install -e .[eval]`):

  python eval.py --suite commonsense --checkpoint WORKDIR [--tasks piqa,hellaswag] [--include_path DIR]
  python -m palimpsa_jax.evaluation.commonsense --model palimpsa_jax \
      --model_args checkpoint=WORKDIR --tasks piqa          (lm-eval's own command line)
  python -m palimpsa_jax.evaluation.commonsense --install-lm-eval-hook    (once; then the plain
      `lm_eval --model palimpsa_jax --model_args checkpoint=WORKDIR ...` works too)

Every scored sequence starts with EOS, as every training document does (palimpsa_jax.data.text).
Requests are scored in batches of fixed shape: lengths are padded to power-of-two buckets, so the
model compiles once per bucket, not per example.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
import json
import os
import sys
import sysconfig
from typing import Any

import numpy as np
import tqdm

try:
  from lm_eval import evaluator as lm_eval_evaluator
  from lm_eval import utils as lm_eval_utils
  from lm_eval.api import model as lm_eval_model
  from lm_eval.api import registry as lm_eval_registry
  from lm_eval.tasks import TaskManager
except ImportError as e:
  raise ImportError("the commonsense suite needs lm-evaluation-harness: "
                    "pip install -e '.[eval]'") from e

from palimpsa_jax import user_errors
from palimpsa_jax.evaluation import lm as lm_lib
from palimpsa_jax.models.decoding import generate

MODEL_NAME = "palimpsa_jax"
# The paper's zero-shot suite.
PAPER_TASKS = ("lambada_openai", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge",
               "social_iqa", "boolq", "wikitext")
DEFAULT_BATCH_SIZE = 16
DEFAULT_MAX_LENGTH = 2048
DEFAULT_MAX_GEN_TOKS = 256
MIN_BUCKET = 32


def length_bucket(length: int, max_length: int) -> int:
  """Padded length for a row of `length` tokens: the next power of two >= MIN_BUCKET, capped."""
  bucket = MIN_BUCKET
  while bucket < length:
    bucket *= 2
  return min(bucket, max_length)


def _batch_size_arg(value: Any) -> int:
  """lm-eval passes batch_size as an int, a digit string or "auto[:n]" (-> the default)."""
  if isinstance(value, str) and value.startswith("auto"):
    return DEFAULT_BATCH_SIZE
  size = int(value)
  if size < 1:
    raise ValueError(f"batch_size must be >= 1, got {value!r}")
  return size


class PalimpsaLM(lm_eval_model.TemplateLM):
  """lm-eval model over a Flax NNX language model (model(tokens [B, T]) -> logits [B, T, V]).

  Built from `checkpoint` (a train.py workdir or checkpoints/<step> folder; lm-eval's
  --model_args checkpoint=...), or from an in-memory `model` and `tokenizer`.

  Args:
    checkpoint: checkpoint to load (with its tokenizer).
    model: an NNX language model, when no checkpoint is given.
    tokenizer: a palimpsa_jax.data.tokenizer.TextTokenizer, with `model`.
    batch_size: rows per scoring batch.
    max_length: longest scored sequence (default: the run's seq_len, else 2048); longer inputs
      keep their last max_length tokens.
    max_gen_toks: default number of generated tokens for generate_until.
    seed: sampling seed for generate_until.
    device, max_batch_size: accepted for lm-eval's command line; JAX picks the device.
  """

  def __init__(self, checkpoint: str | None = None, *, model=None, tokenizer=None,
               batch_size: int | str = DEFAULT_BATCH_SIZE, max_length: int | None = None,
               max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, seed: int = 0,
               device: str | None = None, max_batch_size: int | None = None):
    super().__init__()
    del device, max_batch_size
    run_length = None
    if checkpoint is not None:
      model, config, _, tokenizer = lm_lib.load_checkpoint(str(checkpoint))
      run_length = int(config.seq_len)
    elif model is None or tokenizer is None:
      raise ValueError("PalimpsaLM needs checkpoint=... or both model and tokenizer")
    self._model = model
    self._tokenizer = tokenizer
    self._scorer = lm_lib.ModelScorer(model)
    self.batch_size = _batch_size_arg(batch_size)
    self.max_length = int(max_length or run_length or DEFAULT_MAX_LENGTH)
    if self.max_length < 2:
      raise ValueError(f"max_length must be >= 2, got {max_length!r}")
    self.max_gen_toks = int(max_gen_toks)
    self.seed = int(seed)

  # ---- tokenisation (TemplateLM) ----

  @property
  def eot_token_id(self) -> int:
    return self._tokenizer.eos_id

  @property
  def tokenizer_name(self) -> str:
    return str(self._tokenizer.path)

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    del add_special_tokens, kwargs
    return self._tokenizer.encode(string)

  def tok_decode(self, tokens: Sequence[int]) -> str:
    return self._tokenizer.decode(tokens)

  # ---- scoring ----

  def score_token_pairs(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
                        disable_tqdm: bool = True) -> list[tuple[float, bool]]:
    """Sum of log p(continuation | context) and whether the continuation is greedy.

    Args:
      pairs: (context tokens, continuation tokens); the sequence context + continuation keeps its
        last max_length + 1 tokens.

    Returns:
      (log-likelihood, is_greedy) per pair, in order.
    """
    rows = []
    for context, continuation in pairs:
      if not continuation:
        raise ValueError("a continuation must hold at least one token")
      full = list(context) + list(continuation)
      full = full[-(self.max_length + 1):]
      if len(full) < 2:
        raise ValueError("context + continuation must hold at least 2 tokens")
      rows.append((full, min(len(continuation), len(full) - 1)))
    by_bucket = collections.defaultdict(list)
    for index, (full, _) in enumerate(rows):
      by_bucket[length_bucket(len(full) - 1, self.max_length)].append(index)
    results: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
    chunks = [(bucket, indices[i:i + self.batch_size])
              for bucket, indices in sorted(by_bucket.items())
              for i in range(0, len(indices), self.batch_size)]
    chunks = tqdm.tqdm(chunks, desc="Scoring batches", disable=disable_tqdm)
    for bucket, indices in chunks:
      tokens = np.zeros((self.batch_size, bucket), np.int32)
      targets = np.zeros((self.batch_size, bucket), np.int32)
      for j, index in enumerate(indices):
        full = rows[index][0]
        tokens[j, :len(full) - 1] = full[:-1]
        targets[j, :len(full) - 1] = full[1:]
      log_probs, greedy = self._scorer(tokens, np.zeros_like(tokens), targets)
      for j, index in enumerate(indices):
        full, n_continuation = rows[index]
        stop = len(full) - 1
        start = stop - n_continuation
        results[index] = (float(np.sum(log_probs[j, start:stop], dtype=np.float64)),
                          bool(np.all(greedy[j, start:stop])))
    return results

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
    del kwargs
    pairs = []
    for _, context, continuation in requests:
      if not context or context[0] != self.eot_token_id:
        context = [self.eot_token_id, *context]
      pairs.append((context, continuation))
    results = self.score_token_pairs(pairs, disable_tqdm=disable_tqdm)
    for (request, _, _), result in zip(requests, results):
      self.cache_hook.add_partial("loglikelihood", request, result)
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """Log-likelihood of whole documents, in disjoint windows of max_length (lm-eval's rule)."""
    pairs, owners = [], []
    for index, request in enumerate(requests):
      (string,) = request.args
      windows = lm_eval_utils.get_rolling_token_windows(
          token_list=self.tok_encode(string), prefix_token=self.eot_token_id,
          max_seq_len=self.max_length, context_len=1)
      for window in windows:
        pairs.append(lm_eval_utils.make_disjoint_window(window))
        owners.append(index)
    totals = np.zeros(len(requests), np.float64)
    for owner, (log_likelihood, _) in zip(owners, self.score_token_pairs(pairs, disable_tqdm)):
      totals[owner] += log_likelihood
    results = totals.tolist()
    for request, result in zip(requests, results):
      self.cache_hook.add_partial("loglikelihood_rolling", (request.args[0],), result)
    return results

  # ---- generation ----

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Decodes with palimpsa_jax.models.decoding.generate, stopping at the `until` strings.

    Prompts of equal length and equal generation settings share one generate call.
    """
    groups = collections.defaultdict(list)
    settings = []
    for index, request in enumerate(requests):
      context, gen_kwargs = request.args
      gen_kwargs = dict(gen_kwargs or {})
      until = gen_kwargs.pop("until", None) or []
      until = [until] if isinstance(until, str) else list(until)
      max_new = int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks))
      temperature = float(gen_kwargs.pop("temperature", 0.0) or 0.0)
      do_sample = bool(gen_kwargs.pop("do_sample", temperature > 0))
      top_k = int(gen_kwargs.pop("top_k", 0) or 0)
      if not do_sample:
        temperature, top_k = 0.0, 0  # Greedy.
      prompt = [self.eot_token_id, *self.tok_encode(context)]
      prompt = prompt[-max(1, self.max_length - max_new):]
      settings.append(until)
      groups[(len(prompt), max_new, temperature, top_k)].append((index, prompt))
    outputs = [""] * len(requests)
    for (_, max_new, temperature, top_k), members in groups.items():
      prompts = np.asarray([p for _, p in members], np.int32)
      generated = np.asarray(generate(self._model, prompts, max_new, temperature, top_k,
                                      self.seed))  # [b, max_new]
      for (index, _), tokens in zip(members, generated):
        tokens = tokens.tolist()
        if self.eot_token_id in tokens:
          tokens = tokens[:tokens.index(self.eot_token_id)]
        text = self.tok_decode(tokens)
        for stop in settings[index]:
          if stop and stop in text:
            text = text[:text.index(stop)]
        outputs[index] = text
        self.cache_hook.add_partial("generate_until", requests[index].args, text)
    return outputs


# Registered by module path, so that registering again (this module imported anew, or run as
# __main__) is a no-op and the class is imported from its canonical module.
lm_eval_registry.model_registry.register(
    MODEL_NAME, target="palimpsa_jax.evaluation.commonsense:PalimpsaLM")


def _task_list(options: Mapping[str, Any]) -> list[str]:
  tasks = options.get("tasks") or PAPER_TASKS
  if isinstance(tasks, str):
    tasks = tasks.split(",")
  return [t.strip() for t in tasks if t.strip()]


def available_tasks(tasks: Sequence[str], task_manager) -> tuple[list[str], dict[str, str]]:
  """Splits tasks into those whose data load and {task: why not} for the others."""
  available, unavailable = [], {}
  for task in tasks:
    if task not in task_manager.all_tasks:
      unavailable[task] = "unknown task: not in lm-eval's task index nor in --include_path"
      continue
    try:
      task_manager.load([task])
    except Exception as e:  # pylint: disable=broad-except
      # datasets raises ConnectionError, FileNotFoundError, its own errors... when data is
      # neither cached nor reachable.
      unavailable[task] = f"data not available: {type(e).__name__}: {e}"
      continue
    available.append(task)
  for task, reason in unavailable.items():
    print(f"commonsense: skipping task {task!r}: {reason}", file=sys.stderr, flush=True)
  return available, unavailable


def evaluate_tasks(lm: PalimpsaLM, tasks: Sequence[str], task_manager,
                   limit: int | float | None = None,
                   bootstrap_iters: int = 100_000) -> dict[str, Any]:
  """Runs lm-eval on tasks; returns its results without per-sample logs, JSON-safe."""
  output = lm_eval_evaluator.simple_evaluate(
      model=lm, tasks=list(tasks), task_manager=task_manager, limit=limit, log_samples=False,
      bootstrap_iters=bootstrap_iters)
  output = {k: v for k, v in (output or {}).items() if k != "samples"}
  return json.loads(json.dumps(output, default=lm_eval_utils.handle_non_serializable))


def run(options: Mapping[str, Any]) -> dict[str, Any]:
  """eval.py --suite commonsense.

  Options: "checkpoint" (list), "tasks" (list or comma-separated; default PAPER_TASKS),
  "include_path" (folder of extra task YAMLs), "max_length", "batch_size", "limit" (examples per
  task, for quick runs).

  Returns:
    lm-eval's output ("results": task -> metric -> value, "versions", "n-shot", "configs", ...)
    plus "unavailable": {task: reason}; for several checkpoints {"checkpoints": {path: that}}.
  """
  checkpoints = lm_lib.checkpoints_option(options)
  task_manager = TaskManager(include_path=options.get("include_path"))
  tasks, unavailable = available_tasks(_task_list(options), task_manager)
  if not tasks:
    raise user_errors.UserError("no task could be evaluated: " + "; ".join(
        f"{task}: {reason}" for task, reason in unavailable.items()))
  outputs = {}
  for checkpoint in checkpoints:
    lm = PalimpsaLM(checkpoint, batch_size=options.get("batch_size") or DEFAULT_BATCH_SIZE,
                    max_length=lm_lib.int_option(options, "max_length", None))
    output = evaluate_tasks(lm, tasks, task_manager, options.get("limit"))
    outputs[checkpoint] = {**output, "unavailable": unavailable}
    print(lm_eval_utils.make_table(outputs[checkpoint]), flush=True)
  if len(checkpoints) == 1:
    return outputs[checkpoints[0]]
  return {"checkpoints": outputs}


HOOK_FILE = "palimpsa_jax_lm_eval.pth"
# A .pth line runs at interpreter start; this one imports the adapter only in lm_eval processes.
_HOOK_LINE = ("import sys; sys.argv and sys.argv[0].endswith(('lm_eval', 'lm-eval')) and "
              "__import__('palimpsa_jax.evaluation.commonsense')\n")


def install_lm_eval_hook(site_packages: str | None = None) -> str:
  """Makes lm-eval's own `lm_eval` command know --model palimpsa_jax.

  lm-eval has no plugin entry point for models, so this writes a one-line .pth file into
  site-packages that registers the adapter when (and only when) the `lm_eval` command starts.

  Returns:
    The path of the .pth file.
  """
  directory = site_packages or sysconfig.get_paths()["purelib"]
  path = os.path.join(directory, HOOK_FILE)
  with open(path, "w") as f:
    f.write(_HOOK_LINE)
  return path


def main() -> None:
  """lm-eval's command line with "palimpsa_jax" registered.

  `--install-lm-eval-hook` instead installs the hook that makes the plain `lm_eval` command
  know the model.
  """
  if sys.argv[1:] == ["--install-lm-eval-hook"]:
    print(f"wrote {install_lm_eval_hook()}")
    return
  # Deferred: lm-eval's command-line module is needed only when this runs as a command.
  from lm_eval.__main__ import cli_evaluate  # pylint: disable=g-import-not-at-top
  cli_evaluate()


if __name__ == "__main__":
  main()
