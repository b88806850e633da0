"""lm-eval adapter: registration, loglikelihoods equal to a direct computation, a small
multiple-choice task (YAML + JSONL written here) run offline through lm-eval, missing tasks."""

import functools
import json
import os
import subprocess
import sys
import types

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# pylint: disable=g-import-not-at-top,wrong-import-position
from flax import nnx
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("lm_eval")

from lm_eval.api import instance as lm_eval_instance
from lm_eval.api import registry as lm_eval_registry
from lm_eval import evaluator as lm_eval_evaluator
from lm_eval.tasks import TaskManager

from palimpsa_jax.data import tokenizer as tokenizer_lib
from palimpsa_jax.evaluation import commonsense
from palimpsa_jax import user_errors
from palimpsa_jax.evaluation import lm as lm_lib

VOCAB = 320
MAX_LENGTH = 64
QUESTIONS = [
    {"question": "Where do fish live?", "choices": ["in water", "in trees", "on the moon"],
     "answer": 0},
    {"question": "What melts in the sun?", "choices": ["a rock", "ice cream"], "answer": 1},
    {"question": "Which is a color?", "choices": ["blue", "seven", "quickly"], "answer": 0},
    {"question": "What do cats say?", "choices": ["moo", "meow", "quack"], "answer": 1},
    {"question": "Pick the number.", "choices": ["dog", "banana", "forty two"], "answer": 2},
]


class ContextLM(nnx.Module):
  """Embedding, a causal running mean of the context, tied output: NLL depends on all context."""

  def __init__(self, vocab_size: int, width: int = 16, seed: int = 0):
    rngs = nnx.Rngs(seed)
    self.embed = nnx.Embed(vocab_size, width, rngs=rngs)
    self.mix = nnx.Linear(2 * width, width, rngs=rngs)

  def __call__(self, tokens, segment_ids=None):
    del segment_ids
    x = self.embed(tokens)
    steps = jnp.arange(1, tokens.shape[1] + 1, dtype=x.dtype)[None, :, None]
    context = jnp.cumsum(x, axis=1) / steps
    return self.embed.attend(x + 3.0 * jnp.tanh(self.mix(jnp.concatenate([x, context], -1))))


@pytest.fixture(name="setup", scope="module")
def _setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("commonsense")
  with open(root / "train.jsonl", "w") as f:
    for q in QUESTIONS:
      f.write(json.dumps({"text": q["question"] + " " + " ".join(q["choices"])}) + "\n")
  tok = tokenizer_lib.load_or_train_tokenizer(f"bpe:{VOCAB}", str(root / "train.jsonl"), str(root))
  model = ContextLM(tok.vocab_size)
  lm = commonsense.PalimpsaLM(model=model, tokenizer=tok, batch_size=3, max_length=MAX_LENGTH)
  return types.SimpleNamespace(root=root, tok=tok, model=model, lm=lm)


def _direct_loglikelihood(setup, context, continuation):
  """log p(continuation | EOS + context), the model called on the exact sequence alone."""
  spaces = len(context) - len(context.rstrip())
  if spaces:
    context, continuation = context[:-spaces], context[-spaces:] + continuation
  context_ids = setup.tok.encode(context)
  continuation_ids = setup.tok.encode(context + continuation)[len(context_ids):]
  sequence = ([setup.tok.eos_id] + context_ids + continuation_ids)[-(MAX_LENGTH + 1):]
  n = min(len(continuation_ids), len(sequence) - 1)
  logits = np.asarray(setup.model(jnp.asarray([sequence[:-1]])), np.float64)[0]
  top = logits.max(-1, keepdims=True)
  log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
  targets = np.asarray(sequence[1:])
  picked = log_probs[np.arange(len(targets)), targets][-n:]
  greedy = (logits.argmax(-1) == targets)[-n:]
  return picked.sum(), bool(greedy.all())


def _requests(kind, args):
  return [lm_eval_instance.Instance(request_type=kind, doc={}, arguments=a, idx=i)
          for i, a in enumerate(args)]


def test_registered():
  assert lm_eval_registry.get_model(commonsense.MODEL_NAME) is commonsense.PalimpsaLM


def test_loglikelihood_equals_direct_computation(setup):
  long_context = " ".join(q["question"] for q in QUESTIONS) * 3  # Over MAX_LENGTH tokens.
  pairs = [("Where do fish live?", " in water"), ("Where do fish live? ", "in trees"),
           ("", "Which is a color?"), (long_context, " meow"), ("Pick", " the number."),
           ("What melts in the sun?\nAnswer:", " ice cream"), ("x", " y z " * 20)]
  got = setup.lm.loglikelihood(_requests("loglikelihood", pairs), disable_tqdm=True)
  for (context, continuation), (log_likelihood, greedy) in zip(pairs, got):
    want, want_greedy = _direct_loglikelihood(setup, context, continuation)
    np.testing.assert_allclose(log_likelihood, want, rtol=1e-5)
    assert greedy == want_greedy


def test_loglikelihood_rolling(setup):
  short = "What do cats say? meow"
  long = " ".join(q["question"] for q in QUESTIONS) * 4
  got = setup.lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(short,), (long,)]),
                                       disable_tqdm=True)
  np.testing.assert_allclose(got[0], _direct_loglikelihood(setup, "", short)[0], rtol=1e-5)
  # The long document: disjoint windows, each token predicted once.
  ids = setup.tok.encode(long)
  assert len(ids) > 2 * MAX_LENGTH
  want = _direct_loglikelihood(setup, "", setup.tok.decode(ids[:MAX_LENGTH]))[0]
  assert got[1] < want < 0


def _write_task(root):
  task_dir = root / "tasks"
  task_dir.mkdir(exist_ok=True)
  data = task_dir / "tiny_mc.jsonl"
  with open(data, "w") as f:
    for q in QUESTIONS:
      f.write(json.dumps(q) + "\n")
  (task_dir / "tiny_mc.yaml").write_text(
      "task: tiny_mc\n"
      "dataset_path: json\n"
      f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
      "test_split: test\n"
      "output_type: multiple_choice\n"
      "doc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
      "doc_to_choice: \"{{choices}}\"\n"
      "doc_to_target: answer\n"
      "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
      "metadata:\n  version: 1.0\n")
  (task_dir / "tiny_missing.yaml").write_text(
      "task: tiny_missing\n"
      "dataset_path: json\n"
      f"dataset_kwargs:\n  data_files:\n    test: {task_dir / 'absent.jsonl'}\n"
      "test_split: test\n"
      "output_type: multiple_choice\n"
      "doc_to_text: \"{{question}}\"\n"
      "doc_to_choice: \"{{choices}}\"\n"
      "doc_to_target: answer\n")
  return str(task_dir)


def _direct_accuracy(setup):
  correct = 0
  for q in QUESTIONS:
    context = f"Question: {q['question']}\nAnswer:"
    scores = [_direct_loglikelihood(setup, context, " " + c)[0] for c in q["choices"]]
    correct += int(np.argmax(scores) == q["answer"])
  return correct / len(QUESTIONS)


def test_task_through_lm_eval_and_run(setup, monkeypatch):
  include_path = _write_task(setup.root)
  monkeypatch.setattr(commonsense, "TaskManager",
                      functools.partial(TaskManager, include_defaults=False))
  config = ml_collections.ConfigDict({"seq_len": MAX_LENGTH,
                                      "data": {"tokenizer": f"bpe:{VOCAB}"}})
  checkpoint = str(setup.root)
  monkeypatch.setattr(lm_lib, "load_checkpoint", lambda c: (
      setup.model, config, 3, lm_lib.checkpoint_tokenizer(c, config)))
  # lm-eval's own entry point, the model by its registered name.
  output = lm_eval_evaluator.simple_evaluate(
      model=commonsense.MODEL_NAME, model_args=f"checkpoint={checkpoint},batch_size=2",
      tasks=["tiny_mc"], task_manager=commonsense.TaskManager(include_path=include_path),
      log_samples=False, bootstrap_iters=0)
  accuracy = _direct_accuracy(setup)
  assert output["results"]["tiny_mc"]["acc,none"] == pytest.approx(accuracy)
  # eval.py's suite: missing data and unknown tasks are reported, the others evaluated.
  result = commonsense.run({"checkpoint": [checkpoint], "include_path": include_path,
                            "tasks": "tiny_mc,tiny_missing,no_such_task", "batch_size": 4})
  assert result["results"]["tiny_mc"]["acc,none"] == pytest.approx(accuracy)
  assert set(result["unavailable"]) == {"tiny_missing", "no_such_task"}
  assert "data not available" in result["unavailable"]["tiny_missing"]
  assert "unknown task" in result["unavailable"]["no_such_task"]
  json.dumps(result)
  with pytest.raises(user_errors.UserError, match=(
      "no task could be evaluated: tiny_missing: .*data not available.*; no_such_task: ")):
    commonsense.run({"checkpoint": [checkpoint], "include_path": include_path,
                     "tasks": "tiny_missing,no_such_task"})


def test_generate_until_is_greedy_decoding(setup):
  models = pytest.importorskip("palimpsa_jax.models")
  pytest.importorskip("palimpsa_jax.models.decoding")
  config = models.model_config("palimpsa_d", "tiny", vocab_size=setup.tok.vocab_size,
                               dtype="float32")
  model = models.build_model(config, nnx.Rngs(0))
  new_tokens = 5
  lm = commonsense.PalimpsaLM(model=model, tokenizer=setup.tok, max_length=MAX_LENGTH,
                              max_gen_toks=new_tokens)
  prompts = ["Where do fish live?", "Where do cats live?"]
  prompt_ids = [[setup.tok.eos_id] + setup.tok.encode(p) for p in prompts]
  assert len(prompt_ids[0]) == len(prompt_ids[1])  # One generate call for both.
  got = lm.generate_until(_requests("generate_until", [(p, {"until": ["\n\n"]}) for p in prompts]),
                          disable_tqdm=True)
  # Greedy decoding by hand: full forward passes over a fixed right-padded shape.
  forward = nnx.jit(lambda m, t: m(t))
  length = len(prompt_ids[0])
  tokens = np.zeros((2, length + new_tokens), np.int32)
  tokens[:, :length] = prompt_ids
  for i in range(new_tokens):
    logits = forward(model, jnp.asarray(tokens))
    tokens[:, length + i] = np.asarray(jnp.argmax(logits[:, length + i - 1], axis=-1))
  for row, text in zip(tokens, got):
    new = row[length:].tolist()
    if setup.tok.eos_id in new:
      new = new[:new.index(setup.tok.eos_id)]
    assert text == setup.tok.decode(new).split("\n\n")[0]


def test_lm_eval_command_hook(tmp_path):
  site_dir = tmp_path / "site"
  site_dir.mkdir()
  path = commonsense.install_lm_eval_hook(str(site_dir))
  assert os.path.basename(path) == commonsense.HOOK_FILE
  # A script called lm_eval that processes the hook as site start-up would, then asks lm-eval's
  # registry for the model.
  script = tmp_path / "lm_eval"
  script.write_text(
      "import site, sys\n"
      f"site.addsitedir({str(site_dir)!r})\n"
      "from lm_eval.api.registry import get_model\n"
      "print(get_model('palimpsa_jax').__module__)\n")
  done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True,
                        timeout=120)
  assert done.stdout.strip().splitlines()[-1] == "palimpsa_jax.evaluation.commonsense"
