"""python -m palimpsa_jax.data.prepare and the token-shard pipeline: same rows as on the fly."""

import io
import os
import json

import numpy as np
import pytest

from palimpsa_jax.data import prepare
from palimpsa_jax.data import text
from palimpsa_jax.data import token_shards
from palimpsa_jax.data import tokenizer as tokenizer_lib

WORDS = ["memory", "plastic", "prior", "state", "forget", "learn", "token", "é"]
DOCS = [" ".join(WORDS[(i * j + i) % len(WORDS)] for j in range(5 + 7 * i)) for i in range(17)]


@pytest.fixture(name="prepared", scope="module")
def _prepared(tmp_path_factory):
  """17 documents in a .jsonl, prepared with a BPE of 300 in shards of 100 tokens."""
  root = tmp_path_factory.mktemp("prepare")
  with open(root / "docs.jsonl", "w") as f:
    for doc in DOCS:
      f.write(json.dumps({"text": doc}) + "\n")
  progress = io.StringIO()
  manifest = prepare.prepare(str(root / "docs.jsonl"), "bpe:300", str(root / "tokens"),
                             shard_tokens=100, progress=progress)
  return root, manifest, progress.getvalue()


def test_shards_hold_every_document_as_eos_plus_tokens(prepared):
  root, manifest, progress = prepared
  tokenizer = tokenizer_lib.load_tokenizer(str(root / "tokens" / "tokenizer.json"))
  expected = np.concatenate([[tokenizer.eos_id, *tokenizer.encode(d)] for d in DOCS])
  shards = [np.load(root / "tokens" / s["file"]) for s in manifest["shards"]]
  assert len(shards) > 2 and all(s.dtype == np.uint16 for s in shards)
  assert [len(s) for s in shards[:-1]] == [100] * (len(shards) - 1)
  np.testing.assert_array_equal(np.concatenate(shards), expected)
  assert manifest["num_tokens"] == len(expected) and manifest["num_documents"] == len(DOCS)
  assert "prepare: 17/17 documents (100%)" in progress and "wrote" in progress


def test_shard_rows_equal_the_on_the_fly_rows(prepared):
  """Packing, segment ids, padding and masks match data/text.py's on the same text."""
  root, _, _ = prepared
  tokenizer = tokenizer_lib.load_tokenizer(str(root / "tokens" / "tokenizer.json"))
  on_the_fly = list(text.make_text_eval_dataset(str(root / "docs.jsonl"), tokenizer, 24, 4))
  from_shards = list(token_shards.make_shard_eval_dataset(str(root / "tokens" / "*.npy"), 24, 4))
  assert len(on_the_fly) == len(from_shards) > 2
  for a, b in zip(on_the_fly, from_shards):
    assert sorted(a) == sorted(b) == ["mask", "segment_ids", "tokens"]
    for key in a:
      np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_training_rows_shuffle_per_epoch_and_resume(prepared):
  root, manifest, _ = prepared
  files = str(root / "tokens" / "*.npy")
  rows_per_epoch = manifest["num_tokens"] // 16
  dataset = token_shards.make_shard_dataset(files, 16, 1, seed=3)
  iterator = iter(dataset)
  epoch = [next(iterator)["tokens"][0] for _ in range(rows_per_epoch)]
  state = iterator.get_state()
  following = [next(iterator)["tokens"][0] for _ in range(3)]
  ordered = token_shards.TokenRows(sorted(
      str(root / "tokens" / s["file"]) for s in manifest["shards"]), 0, 16, False)
  assert sorted(map(tuple, epoch)) == sorted(tuple(ordered[i]["tokens"]) for i in
                                             range(rows_per_epoch))
  assert not all(np.array_equal(epoch[i], ordered[i]["tokens"]) for i in range(rows_per_epoch))
  resumed = iter(dataset)
  resumed.set_state(state)
  np.testing.assert_array_equal([next(resumed)["tokens"][0] for _ in range(3)], following)
  two_hosts = [token_shards.make_shard_dataset(files, 16, 1, 3, i, 2) for i in range(2)]
  assert sum(len(list(zip(range(100), iter(d)))) for d in two_hosts) == 200


def test_refuses_to_overwrite_and_incomplete_output(prepared, tmp_path, capsys):
  root, _, _ = prepared
  with pytest.raises(SystemExit) as refused:
    prepare.main(["--files", str(root / "docs.jsonl"), "--tokenizer", "bpe:300",
                  "--output", str(root / "tokens")])
  assert refused.value.code == 1
  assert capsys.readouterr().err.startswith("prepare: ")
  with pytest.raises(FileExistsError, match="already holds prepared tokens"):
    prepare.prepare(str(root / "docs.jsonl"), "bpe:300", str(root / "tokens"))
  (tmp_path / "tokens_00000.npy").write_bytes(b"")
  with pytest.raises(FileNotFoundError, match="no manifest.json"):
    token_shards.make_shard_dataset(str(tmp_path / "*.npy"), 16, 1, 0)
  with pytest.raises(ValueError, match="mixes token shards"):
    token_shards.is_token_shards(str(tmp_path / "*.npy") + "," + str(root / "docs.jsonl"))


def test_tokenizer_of_the_shards_goes_to_the_workdir(prepared, tmp_path):
  root, _, _ = prepared
  files = str(root / "tokens" / "*.npy")
  tokenizer = token_shards.shard_tokenizer(files, "bpe:300", str(tmp_path))
  assert tokenizer.path == tokenizer_lib.bpe_tokenizer_path(str(tmp_path), 300)
  other = tmp_path / "other.json"
  other.write_text("{}")
  with pytest.raises(ValueError, match="is not the tokenizer the token shards"):
    token_shards.shard_tokenizer(files, str(other), str(tmp_path))


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_files_without_text_are_refused_before_anything_is_written(tmp_path, capsys, content):
  (tmp_path / "empty.txt").write_text(content)
  output = tmp_path / "tokens"
  with pytest.raises(SystemExit) as refused:
    prepare.main(["--files", str(tmp_path / "empty.txt"), "--tokenizer", "bpe:300",
                  "--output", str(output)])
  assert refused.value.code == 1
  assert capsys.readouterr().err == (
      f"prepare: --files={str(tmp_path / 'empty.txt')!r}: the 1 matched file(s) hold no "
      "text (every document is empty).\n")
  assert not output.exists()


def test_a_trained_tokenizer_is_readable_by_others(tmp_path):
  tokenizer = tokenizer_lib.train_bpe_tokenizer(iter(["some text " * 20]), 300,
                                                str(tmp_path / "tokenizer.json"))
  umask = os.umask(0)
  os.umask(umask)
  assert os.stat(tokenizer.path).st_mode & 0o777 == 0o666 & ~umask


def test_shards_smaller_than_one_batch_are_refused_with_their_token_count(prepared):
  root, manifest, _ = prepared
  files = str(root / "tokens" / "*.npy")
  rows = manifest["num_tokens"] // 16  # whole rows of 16 tokens
  token_shards.require_one_batch(files, 16, rows, "config.data.train_files")
  with pytest.raises(text.DataError) as small:
    token_shards.require_one_batch(files, 16, rows + 1, "config.data.train_files")
  assert str(small.value) == (
      f"config.data.train_files={files!r} holds {rows * 16} tokens in whole rows, fewer than "
      f"one batch needs ({rows + 1} rows of seq_len 16 = {(rows + 1) * 16} tokens); prepare "
      "more text or use a smaller batch_size or seq_len.")
