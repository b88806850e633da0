"""lm and long_context suites on synthetic cases with tiny models whose NLL is known."""

import errno
import json
import math
import os
import types

from flax import nnx
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

pytest.importorskip("tokenizers")

from palimpsa_jax import user_errors  # pylint: disable=g-import-not-at-top
from palimpsa_jax.data import text as text_lib  # pylint: disable=g-import-not-at-top
from palimpsa_jax.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
from palimpsa_jax.evaluation import lm as lm_lib  # pylint: disable=g-import-not-at-top
from palimpsa_jax.evaluation import long_context  # pylint: disable=g-import-not-at-top
from palimpsa_jax.training import storage  # pylint: disable=g-import-not-at-top

VOCAB = 300
SEQ_LEN = 16
DOCS = [f"Document {i}: " + " ".join(["alpha", "beta", "gamma", "δέλτα"][: 1 + i % 4]) * (1 + i % 3)
        for i in range(12)]


class UniformLM(nnx.Module):
  """Every token has probability 1 / vocab."""

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size

  def __call__(self, tokens, segment_ids=None):
    del segment_ids
    return jnp.zeros(tokens.shape + (self.vocab_size,), jnp.float32)


class BigramLM(nnx.Module):
  """logits[b, t] = table[tokens[b, t]]: the NLL of each prediction is known in closed form."""

  def __init__(self, vocab_size: int, seed: int = 0):
    self.table = nnx.Param(jnp.asarray(
        np.random.default_rng(seed).normal(size=(vocab_size, vocab_size)), jnp.float32))

  def __call__(self, tokens, segment_ids=None):
    del segment_ids
    return self.table[...][tokens]


@pytest.fixture(name="setup", scope="module")
def _setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("lm")
  with open(root / "heldout.jsonl", "w") as f:
    for d in DOCS:
      f.write(json.dumps({"text": d}) + "\n")
  files = str(root / "heldout.jsonl")
  tok = tokenizer_lib.load_or_train_tokenizer(f"bpe:{VOCAB}", files, str(root))
  return types.SimpleNamespace(root=root, files=files, tok=tok)


def _scored_pairs(tok, seq_len):
  """Reference: (row, position of the target in its row segment, token, next token) of every
  scored prediction, from the documents directly."""
  stream, owner = [], []
  for i, d in enumerate(DOCS):
    ids = [tok.eos_id] + tok.encode(d)
    stream += ids
    owner += [i] * len(ids)
  pairs = []
  for start in range(0, len(stream), seq_len):
    row, row_owner = stream[start:start + seq_len], owner[start:start + seq_len]
    segment_start = 0
    for t in range(1, len(row)):
      if row_owner[t] != row_owner[t - 1]:
        segment_start = t
        continue
      pairs.append((start // seq_len, t - segment_start, row[t - 1], row[t]))
  return pairs


def _eval_batches(setup, seq_len=SEQ_LEN, batch_size=3):
  return text_lib.make_text_eval_dataset(setup.files, setup.tok, seq_len, batch_size)


def test_uniform_model_perplexity_is_vocab_size(setup):
  metrics = lm_lib.lm_metrics(lm_lib.ModelScorer(UniformLM(VOCAB)), _eval_batches(setup),
                              setup.tok.token_bytes)
  pairs = _scored_pairs(setup.tok, SEQ_LEN)
  n_bytes = sum(int(setup.tok.token_bytes[b]) for _, _, _, b in pairs)
  assert metrics["tokens"] == len(pairs) and metrics["bytes"] == n_bytes
  np.testing.assert_allclose(metrics["perplexity"], VOCAB, rtol=1e-5)
  np.testing.assert_allclose(metrics["bits_per_byte"], len(pairs) * math.log2(VOCAB) / n_bytes,
                             rtol=1e-5)


def _bigram_nll(model, a, b):
  table = np.asarray(model.table[...], np.float64)
  logits = table[a]
  return float(np.log(np.sum(np.exp(logits - logits.max()))) + logits.max() - logits[b])


def test_bigram_model_nll_matches_closed_form(setup):
  model = BigramLM(VOCAB)
  metrics = lm_lib.lm_metrics(lm_lib.ModelScorer(model), _eval_batches(setup),
                              setup.tok.token_bytes)
  pairs = _scored_pairs(setup.tok, SEQ_LEN)
  nll = sum(_bigram_nll(model, a, b) for _, _, a, b in pairs)
  n_bytes = sum(int(setup.tok.token_bytes[b]) for _, _, _, b in pairs)
  np.testing.assert_allclose(metrics["nll_per_token"], nll / len(pairs), rtol=1e-5)
  np.testing.assert_allclose(metrics["perplexity"], math.exp(nll / len(pairs)), rtol=1e-5)
  np.testing.assert_allclose(metrics["bits_per_byte"], nll / math.log(2) / n_bytes, rtol=1e-5)


def test_bucket_edges_and_positions():
  np.testing.assert_array_equal(long_context.bucket_edges(8), [2, 4, 8])
  np.testing.assert_array_equal(long_context.bucket_edges(12), [2, 4, 8, 12])
  with pytest.raises(ValueError, match="max_length"):
    long_context.bucket_edges(1)
  segments = np.asarray([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(long_context.positions_in_segment(segments),
                                [[0, 1, 2, 0, 1, 0, 1, 2], [0, 0, 1, 2, 3, 4, 5, 6]])
  # NLL = position of the predicted token, so each bucket's sum is the sum of its positions.
  # Scored predictions (same segment): row 0 predicts positions 1, 2 | 1 | 1, 2; row 1 predicts
  # 1, 2, 3, 4, 5, 6. Buckets [1, 2), [2, 4), [4, 8).
  _, weights = text_lib.next_token_targets(np.zeros_like(segments), segments)
  predicted = long_context.positions_in_segment(segments) + 1
  nll, counts = long_context.bucket_nll_sums(-predicted.astype(np.float32), weights, segments,
                                             long_context.bucket_edges(8))
  np.testing.assert_array_equal(counts, [4, 4, 3])
  np.testing.assert_array_equal(nll, [4, 2 + 2 + 2 + 3, 4 + 5 + 6])


def test_a_plot_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
  from matplotlib import figure  # pylint: disable=g-import-not-at-top
  def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  monkeypatch.setattr(figure.Figure, "savefig", full)
  path = str(tmp_path / "nll.png")
  curves = {str(tmp_path / "run"): {"bucket_end": [2, 4], "mean_nll": [1.0, 0.5], "step": 3}}
  with pytest.raises(storage.WriteFailed) as failed:
    long_context.plot_curves(curves, path)
  assert user_errors.message(failed.value) == (
      f"cannot write {path}: No space left on device [ENOSPC]")


def test_long_context_curve_matches_reference(setup):
  model = BigramLM(VOCAB, seed=1)
  max_length = 16
  curve = long_context.nll_by_position(lm_lib.ModelScorer(model),
                                       _eval_batches(setup, max_length, 2), max_length)
  edges = [2, 4, 8, 16]
  sums, counts = np.zeros(4), np.zeros(4)
  for _, position, a, b in _scored_pairs(setup.tok, max_length):
    bucket = next(i for i, e in enumerate(edges) if position < e)
    sums[bucket] += _bigram_nll(model, a, b)
    counts[bucket] += 1
  assert curve["bucket_end"] == edges and curve["count"] == counts.astype(int).tolist()
  np.testing.assert_allclose(curve["mean_nll"], sums / counts, rtol=1e-5)


def _fake_checkpoints(monkeypatch, setup, models):
  config = ml_collections.ConfigDict({"seq_len": SEQ_LEN, "data": {"tokenizer": f"bpe:{VOCAB}"}})

  def load(checkpoint):
    return models[checkpoint], config, 7, lm_lib.checkpoint_tokenizer(checkpoint, config)
  monkeypatch.setattr(lm_lib, "load_checkpoint", load)


def test_run_suites(setup, monkeypatch):
  ckpt_dir = setup.root / "checkpoints" / "7"
  ckpt_dir.mkdir(parents=True)
  a, b = str(ckpt_dir), str(setup.root)
  _fake_checkpoints(monkeypatch, setup, {a: UniformLM(VOCAB), b: BigramLM(VOCAB)})
  result = lm_lib.run({"checkpoint": [a], "files": setup.files, "batch_size": 2})
  assert result["files"] == setup.files and list(result["checkpoints"]) == [a]
  result = result["checkpoints"][a]
  np.testing.assert_allclose(result["perplexity"], VOCAB, rtol=1e-5)
  assert {"bits_per_byte", "step", "seq_len"} <= set(result) and result["seq_len"] == SEQ_LEN
  both = lm_lib.run({"checkpoint": f"{a},{b}", "files": setup.files, "max_length": 8})
  assert set(both["checkpoints"]) == {a, b}  # the same form as for one checkpoint
  output = str(setup.root / "out" / "long.json")
  curves = long_context.run({"checkpoint": [a, b], "files": setup.files, "max_length": 8,
                             "output": output})
  assert curves["bucket_end"] == [2, 4, 8] and set(curves["checkpoints"]) == {a, b}
  np.testing.assert_allclose(curves["checkpoints"][a]["mean_nll"], math.log(VOCAB),
                             rtol=1e-5)
  with open(curves["plot"], "rb") as f:
    assert curves["plot"].endswith("long.png") and f.read(8) == b"\x89PNG\r\n\x1a\n"
  json.dumps(curves)
  # Without --output the plot goes to the workdir of a checkpoints/<step> folder.
  single = long_context.run({"checkpoint": [a], "files": setup.files, "max_length": 8})
  assert single["plot"] == str(setup.root / "eval_long_context.png")
  with pytest.raises(ValueError, match="files"):
    lm_lib.run({"checkpoint": [a]})
  with pytest.raises(ValueError, match="checkpoint"):
    long_context.run({"files": setup.files})


def test_checkpoint_tokenizer_not_found(tmp_path):
  config = ml_collections.ConfigDict({"data": {"tokenizer": "bpe:512"}})
  with pytest.raises(FileNotFoundError, match="tokenizer_bpe512.json"):
    lm_lib.checkpoint_tokenizer(str(tmp_path), config)


def test_suites_on_a_trained_checkpoint(setup, tmp_path):
  """train.py's LM task for 2 steps, then eval.py's lm and long_context suites on its workdir."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  from palimpsa_jax.evaluation import suites  # pylint: disable=g-import-not-at-top
  from palimpsa_jax.training import trainer  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(__file__).resolve().parents[2] / "configs" / "lm.py"
  spec = importlib.util.spec_from_file_location("lm_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("model=palimpsa_d,size=tiny,seq_len=16,batch_size=2,total_steps=2,"
                             "warmup_steps=1,dtype=float32")
  config.model.vocab_size = VOCAB
  config.data.train_files = setup.files
  config.data.eval_files = ""
  config.data.tokenizer = f"bpe:{VOCAB}"
  config.log_every_steps = config.checkpoint_every_steps = 2
  config.async_checkpointing = False
  workdir = str(tmp_path / "run")
  trainer.train_and_evaluate(config, workdir)
  result = suites.SUITES["lm"]({"checkpoint": [workdir], "files": setup.files, "batch_size": 2})
  result = result["checkpoints"][workdir]
  assert result["step"] == 2 and result["seq_len"] == 16
  assert result["tokens"] == len(_scored_pairs(setup.tok, 16))
  assert 1 < result["perplexity"] < 2 * VOCAB and result["bits_per_byte"] > 0
  curves = suites.SUITES["long_context"]({"checkpoint": [workdir + "/checkpoints/2"],
                                          "files": setup.files, "max_length": 16})
  assert curves["checkpoints"][workdir + "/checkpoints/2"]["step"] == 2
  assert curves["plot"] == workdir + "/eval_long_context.png"


@pytest.mark.parametrize("suite", [lm_lib, long_context])
def test_held_out_files_without_text_are_refused_before_any_checkpoint_loads(suite, tmp_path,
                                                                             monkeypatch):
  empty = tmp_path / "e.txt"
  empty.write_text("")
  monkeypatch.setattr(lm_lib, "load_checkpoint", lambda _: pytest.fail("loaded a checkpoint"))
  with pytest.raises(text_lib.DataError, match=r"--files=.*e\.txt.*hold no text"):
    suite.run({"checkpoint": [str(tmp_path)], "files": str(empty)})


def test_lm_table_says_when_checkpoints_were_scored_at_different_lengths():
  row = {"step": 7, "tokens": 1200, "perplexity": 30.0, "bits_per_byte": 1.5}
  same = lm_lib.format_table({"runs/a": {**row, "seq_len": 128}, "runs/b": {**row, "seq_len": 128}})
  assert "seq_len" in same.splitlines()[0] and "note" not in same
  mixed = lm_lib.format_table({"runs/a": {**row, "seq_len": 128},
                               "runs/b": {**row, "seq_len": 2048}})
  assert "different context lengths" in mixed.splitlines()[-1]
