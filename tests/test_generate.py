"""generate.py and palimpsa_jax.evaluation.generation on a tiny Palimpsa-D LM checkpoint."""

import json
import pathlib
import shutil
import subprocess
import sys
import types

from flax import nnx
import ml_collections
import numpy as np
import pytest

from palimpsa_jax import models
from palimpsa_jax import user_errors
from palimpsa_jax.data import text as text_lib
from palimpsa_jax.data import tokenizer as tokenizer_lib
from palimpsa_jax.evaluation import generation
from palimpsa_jax.evaluation import lm as lm_lib
from tests.conversion import mamba2_fixtures as fx

pytest.importorskip("tokenizers")

REPO = pathlib.Path(__file__).parents[1]
VOCAB = 300
DOCS = [f"Document {i}: " + "alpha beta gamma δέλτα " * (1 + i % 3) for i in range(8)]


@pytest.fixture(name="lm", scope="module")
def _lm(tmp_path_factory):
  """A train.py LM workdir of a 1-layer Palimpsa-D (random weights, a bpe tokenizer)."""
  root = tmp_path_factory.mktemp("generate")
  files = root / "docs.jsonl"
  files.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
  workdir = root / "run"
  workdir.mkdir()
  tokenizer_lib.load_or_train_tokenizer(f"bpe:{VOCAB}", str(files), str(workdir))
  config = models.model_config("palimpsa_d", "tiny", num_layers=1, vocab_size=VOCAB,
                               dtype="float32")
  _, params, _ = models.split_model(models.build_model(config, nnx.Rngs(0)))
  fx.write_workdir(str(workdir), config, params, ml_collections.ConfigDict(
      {"task": "lm", "seq_len": 16, "seed": 0, "data": {"tokenizer": f"bpe:{VOCAB}"}}))
  model, _, _, tokenizer = lm_lib.load_checkpoint(str(workdir))
  return types.SimpleNamespace(root=root, workdir=str(workdir), model=model, tokenizer=tokenizer)


def _sample(lm, prompt, **settings):
  written = []
  texts, timing = generation.sample(lm.model, lm.tokenizer, prompt,
                                    generation.Sampling(**settings), written.append)
  return texts, timing, "".join(written)


def test_prompts_start_with_eos_as_training_documents_do(lm):
  ids = generation.prompt_ids(lm.tokenizer, "Document 1")
  assert ids == [lm.tokenizer.eos_id] + lm.tokenizer.encode("Document 1")
  assert generation.prompt_ids(lm.tokenizer, "") == [lm.tokenizer.eos_id]


def test_sample_streams_one_sample_and_is_deterministic_per_seed(lm):
  (text,), timing, written = _sample(lm, "Document", max_new_tokens=6, seed=1)
  assert written == text and timing.prompt_tokens == len(generation.prompt_ids(lm.tokenizer,
                                                                                "Document"))
  assert 1 <= timing.new_tokens <= 6 and timing.rest_tokens == timing.new_tokens - 1
  assert _sample(lm, "Document", max_new_tokens=6, seed=1)[0] == [text]
  texts, timing, written = _sample(lm, "Document", max_new_tokens=6, seed=1, num_samples=3,
                                   top_k=50, top_p=0.9)
  assert len(texts) == 3 and written.count("--- sample ") == 3
  assert written.startswith("--- sample 1 ---\nDocument" + texts[0] + "\n")
  assert "tokens/s" in generation.timing_line([timing])


def test_text_stream_holds_back_an_incomplete_character(lm):
  ids = lm.tokenizer.encode("δέλτα")
  pieces, stream = [], generation.TextStream(lm.tokenizer)
  for token in ids:
    piece = stream.add(token)
    assert "\ufffd" not in piece
    pieces.append(piece)
  assert "".join(pieces) + stream.flush() == "δέλτα"


def test_lm_tools_reject_an_mqar_checkpoint(tmp_path):
  config = models.model_config("palimpsa_d", "tiny", num_layers=1)
  _, params, _ = models.split_model(models.build_model(config, nnx.Rngs(0)))
  fx.write_workdir(str(tmp_path), config, params, ml_collections.ConfigDict({"task": "mqar",
                                                                           "seed": 0}))
  with pytest.raises(user_errors.UserError) as refused:
    lm_lib.load_checkpoint(str(tmp_path))
  assert str(refused.value) == (
      f"checkpoint {tmp_path} was trained on task 'mqar' (its saved config); a language "
      "model's evaluation or sampling needs a run of task 'lm'.")


def test_printed_text_escapes_control_characters_but_keeps_newlines_and_tabs():
  assert generation.printable("bell\x07 back\x08\tesc\x1b[31m\nline\r\x7f\x9b δ 😀") == (
      "bell\\x07 back\\x08\tesc\\x1b[31m\nline\\x0d\\x7f\\x9b δ 😀")


def test_prompt_file_that_is_not_utf8_names_its_byte(tmp_path):
  path = tmp_path / "prompts.txt"
  path.write_bytes(b"first\r\nsecond \x80\n")
  with pytest.raises(text_lib.DataError, match=r"prompts.txt: byte 14 \(0x80\) is not UTF-8"):
    generation.read_prompt_file(str(path))
  path.write_bytes(b"first\r\n\r\nsecond\rthird\n")
  assert generation.read_prompt_file(str(path)) == ["first", "second", "third"]


def _generate(*args):
  return subprocess.run([sys.executable, "generate.py", *args], cwd=REPO, capture_output=True,
                        text=True, timeout=600, check=False)


def test_command_line_with_a_prompt_file(lm):
  prompts = lm.root / "prompts.txt"
  prompts.write_text("Document 1:\n\nalpha\x07 beta\n")
  result = _generate("--checkpoint", lm.workdir, "--prompt_file", str(prompts),
                     "--max_new_tokens", "5", "--temperature", "0")
  assert result.returncode == 0, result.stderr
  expected = "".join(
      f"=== prompt {i + 1}/2 ===\n{p}{_sample(lm, p, max_new_tokens=5, temperature=0.0)[0][0]}\n"
      for i, p in enumerate(["Document 1:", "alpha\x07 beta"]))
  assert result.stdout == generation.printable(expected)
  assert "alpha\\x07 beta" in result.stdout and "\x07" not in result.stdout
  assert "new tokens for 2 prompt(s)" in result.stderr and "tokens/s" in result.stderr
  result = _generate("--checkpoint", lm.workdir)
  assert result.returncode != 0 and "exactly one of --prompt and --prompt_file" in result.stderr


def test_export_carries_the_tokenizer_and_import_brings_it_back(lm, tmp_path):
  """The authors' format with the model's own tokenizer: imported back, the model samples the
  same text with no file copied by hand."""
  from palimpsa_jax.conversion import torch_checkpoints  # pylint: disable=g-import-not-at-top
  exported, again = tmp_path / "authors", tmp_path / "again"
  torch_checkpoints.export_checkpoint(lm.workdir, str(exported), verbose=False)
  trained = pathlib.Path(tokenizer_lib.bpe_tokenizer_path(lm.workdir, VOCAB))
  assert (exported / "tokenizer.json").read_bytes() == trained.read_bytes()
  torch_checkpoints.import_checkpoint(str(exported), str(again), verbose=False)
  shutil.rmtree(exported)  # the imported model reads its own copy
  model, _, _, tokenizer = lm_lib.load_checkpoint(str(again))
  assert tokenizer.path == str(again / "tokenizer.json")
  greedy = dict(max_new_tokens=6, temperature=0.0)
  assert (generation.sample(model, tokenizer, "Document", generation.Sampling(**greedy),
                            lambda _: None)[0] == _sample(lm, "Document", **greedy)[0])


def test_sampling_settings_out_of_range_are_refused_as_the_flags_are():
  with pytest.raises(generation.SamplingError, match=r"^top_p must be a number in \(0, 1\], got"):
    generation.Sampling(top_p=1.5)
  with pytest.raises(generation.SamplingError, match="max_new_tokens must be a positive int"):
    generation.Sampling(max_new_tokens=0)
