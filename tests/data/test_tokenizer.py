"""Tokenizer: training a byte-level BPE on the training files, reusing and loading it."""

import json
import os

import pytest

pytest.importorskip("tokenizers")

from palimpsa_jax.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top

TEXTS = [f"The quick brown fox {i} jumps over the lazy dog. Ünïcödé → 東京 {i * i}" for i in range(50)]


@pytest.fixture(name="train_glob")
def _train_glob(tmp_path):
  with open(tmp_path / "train.jsonl", "w") as f:
    for t in TEXTS:
      f.write(json.dumps({"text": t}) + "\n")
  return str(tmp_path / "*.jsonl")


def test_train_reuse_and_load(tmp_path, train_glob):
  workdir = str(tmp_path / "work")
  tok = tokenizer_lib.load_or_train_tokenizer("bpe:400", train_glob, workdir)
  path = tokenizer_lib.bpe_tokenizer_path(workdir, 400)
  assert os.path.isfile(path) and tok.path == path
  assert tok.vocab_size == 400 and tok.eos_id == 0
  ids = tok.encode(TEXTS[3])
  assert tok.eos_id not in ids
  assert len(ids) < len(TEXTS[3].encode("utf-8"))  # Merges were learnt.
  assert tok.decode(ids) == TEXTS[3]
  # Reused from the workdir: no training files needed.
  again = tokenizer_lib.load_or_train_tokenizer("bpe:400", None, workdir)
  assert again.encode(TEXTS[3]) == ids
  loaded = tokenizer_lib.load_or_train_tokenizer(path, None, None)
  assert loaded.encode("never seen: żółw") == tok.encode("never seen: żółw")


def test_token_bytes_count_utf8_bytes(tmp_path, train_glob):
  tok = tokenizer_lib.load_or_train_tokenizer("bpe:300", train_glob, str(tmp_path))
  assert tok.token_bytes.shape == (300,) and tok.token_bytes[tok.eos_id] == 0
  for s in ["plain ascii", "東京 → Ünïcödé", "tabs\tand\nnewlines  ", TEXTS[7]]:
    assert tok.token_bytes[tok.encode(s)].sum() == len(s.encode("utf-8"))


def test_errors(tmp_path, train_glob):
  with pytest.raises(FileNotFoundError, match="missing.json"):
    tokenizer_lib.load_or_train_tokenizer(str(tmp_path / "missing.json"), None, None)
  with pytest.raises(ValueError, match="bpe:<vocab_size>"):
    tokenizer_lib.load_or_train_tokenizer("bpe:lots", train_glob, str(tmp_path))
  with pytest.raises(ValueError, match="workdir"):
    tokenizer_lib.load_or_train_tokenizer("bpe:300", train_glob, None)
  with pytest.raises(FileNotFoundError, match="train_files"):
    tokenizer_lib.load_or_train_tokenizer("bpe:300", None, str(tmp_path / "empty"))
  with pytest.raises(FileNotFoundError, match="nope"):
    tokenizer_lib.load_or_train_tokenizer("bpe:300", str(tmp_path / "nope*.txt"), str(tmp_path))
  with pytest.raises(ValueError, match="vocab_size"):
    tokenizer_lib.load_or_train_tokenizer("bpe:100", train_glob, str(tmp_path))
  # A tokenizer.json without an end-of-sequence token.
  tok = tokenizer_lib.load_or_train_tokenizer("bpe:300", train_glob, str(tmp_path))
  spec = json.loads(tok.hf.to_str())
  spec["added_tokens"] = []
  del spec["model"]["vocab"][tokenizer_lib.EOS_TOKEN]
  (tmp_path / "no_eos.json").write_text(json.dumps(spec))
  with pytest.raises(ValueError, match="end-of-sequence"):
    tokenizer_lib.load_tokenizer(str(tmp_path / "no_eos.json"))
