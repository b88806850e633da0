"""Text pipeline: reading, packing, segment ids, determinism, sharding, iterator state."""

import json

import numpy as np
import pytest

from palimpsa_jax.data import text

EOS = 0


class CharTokenizer:
  """One token per character (ids 1..255), EOS = 0."""

  eos_id = EOS

  def encode(self, s):
    return [ord(c) % 255 + 1 for c in s]


DOCS = [f"doc{i}:" + "xyz"[i % 3] * (i % 11) for i in range(23)]


def _write_jsonl(path, docs):
  with open(path, "w") as f:
    for d in docs:
      f.write(json.dumps({"text": d, "id": 1}) + "\n")
    f.write("\n")  # A trailing blank line is not a document.


@pytest.fixture(name="corpus")
def _corpus(tmp_path):
  _write_jsonl(tmp_path / "a.jsonl", DOCS[:15])
  for i, d in enumerate(DOCS[15:]):
    (tmp_path / f"b{i}.txt").write_text(d)
  # Sorted order: a.jsonl, b0.txt, ..., b7.txt == DOCS order.
  return str(tmp_path / "*.jsonl") + "," + str(tmp_path / "*.txt")


def _stream(docs):
  """Reference packing: token stream and each token's document index."""
  tokens, owner = [], []
  for i, d in enumerate(docs):
    ids = [EOS] + CharTokenizer().encode(d)
    tokens += ids
    owner += [i] * len(ids)
  return np.asarray(tokens), np.asarray(owner)


def _reference_segments(owner_rows):
  """Document index within each row, from 0."""
  out = np.zeros_like(owner_rows)
  for r, row in enumerate(owner_rows):
    out[r] = np.concatenate([[0], np.cumsum(row[1:] != row[:-1])])
  return out


def test_eval_packing_and_segment_ids(corpus):
  seq_len, batch = 16, 3
  batches = list(text.make_text_eval_dataset(corpus, CharTokenizer(), seq_len, batch))
  tokens = np.concatenate([b["tokens"] for b in batches])
  segments = np.concatenate([b["segment_ids"] for b in batches])
  mask = np.concatenate([b["mask"] for b in batches])
  assert all(b["tokens"].shape == (batch, seq_len) and b["tokens"].dtype == np.int32
             for b in batches)
  stream, owner = _stream(DOCS)
  n_rows = -(-len(stream) // seq_len)
  assert len(tokens) == -(-n_rows // batch) * batch
  np.testing.assert_array_equal(tokens[mask > 0], stream)
  assert mask.sum() == len(stream) and mask[:n_rows - 1].all()
  padded_owner = np.concatenate([owner, np.full(n_rows * seq_len - len(owner), -1)])
  expected = _reference_segments(padded_owner.reshape(n_rows, seq_len))
  np.testing.assert_array_equal(segments[:n_rows], expected)
  # Padding never continues a document.
  last = n_rows - 1
  pad = mask[last] == 0
  assert (segments[last][pad] > segments[last][~pad].max()).all()


def test_document_continuing_into_next_row_gets_new_segment(corpus):
  rows = next(iter(text.make_text_eval_dataset(corpus, CharTokenizer(), 8, 4)))
  # DOCS[0] is EOS + 5 tokens, DOCS[1] EOS + 6: doc 1 starts in row 0 and continues in row 1,
  # where it is segment 0 again; doc 2 starts at 5 in row 1.
  np.testing.assert_array_equal(rows["segment_ids"][0], [0] * 6 + [1, 1])
  np.testing.assert_array_equal(rows["segment_ids"][1], [0] * 5 + [1, 1, 1])
  assert rows["tokens"][0][6] == EOS and rows["tokens"][1][5] == EOS


def _take(ds, n):
  it = iter(ds)
  return [next(it) for _ in range(n)]


def test_training_is_deterministic_and_covers_documents(corpus):
  tok = CharTokenizer()
  a = _take(text.make_text_dataset(corpus, tok, 12, 2, seed=3), 12)
  b = _take(text.make_text_dataset(corpus, tok, 12, 2, seed=3), 12)
  c = _take(text.make_text_dataset(corpus, tok, 12, 2, seed=4), 6)
  assert set(a[0]) == {"tokens", "segment_ids"}
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x["tokens"], y["tokens"])
    np.testing.assert_array_equal(x["segment_ids"], y["segment_ids"])
  assert any((x["tokens"] != y["tokens"]).any() for x, y in zip(a, c))
  # One epoch's worth of rows holds every document once (as a contiguous run).
  stream, _ = _stream(DOCS)
  assert len(stream) <= 12 * 2 * 12
  epoch = np.concatenate([x["tokens"].reshape(-1) for x in a])[:len(stream)]
  assert sorted(epoch.tolist()) == sorted(stream.tolist())
  assert (epoch != stream).any()  # Shuffled.


def test_shards_split_documents(corpus):
  tok = CharTokenizer()
  shards = []
  for index in range(3):
    rows = list(text.make_text_eval_dataset(corpus, tok, 64, 1, shard_index=index, shard_count=3))
    tokens = np.concatenate([r["tokens"][r["mask"] > 0] for r in rows])
    shards.append(tokens)
    stream, _ = _stream(DOCS[index::3])
    np.testing.assert_array_equal(tokens, stream)
  assert sum(len(s) for s in shards) == len(_stream(DOCS)[0])
  first = _take(text.make_text_dataset(corpus, tok, 12, 2, seed=0, shard_index=0, shard_count=2), 2)
  second = _take(text.make_text_dataset(corpus, tok, 12, 2, seed=0, shard_index=1, shard_count=2), 2)
  assert (first[0]["tokens"] != second[0]["tokens"]).any()


def test_iterator_state_restores(corpus):
  ds = text.make_text_dataset(corpus, CharTokenizer(), 10, 2, seed=1)
  it = iter(ds)
  for _ in range(15):  # Past the first epoch (23 documents ~ 13 batches).
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it) for _ in range(9)]
  restored = iter(ds)
  restored.set_state(state)
  for want in expected:
    got = next(restored)
    np.testing.assert_array_equal(got["tokens"], want["tokens"])
    np.testing.assert_array_equal(got["segment_ids"], want["segment_ids"])


def test_parquet_and_array_record_sources(tmp_path):
  pa = pytest.importorskip("pyarrow")
  pq = pytest.importorskip("pyarrow.parquet")
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  pq.write_table(pa.table({"text": DOCS[:10]}), tmp_path / "a.parquet", row_group_size=3)
  writer = array_record_module.ArrayRecordWriter(str(tmp_path / "b.array_record"), "group_size:1")
  for d in DOCS[10:]:
    writer.write(d.encode("utf-8"))
  writer.close()
  source = text.DocumentSource(text.resolve_files(str(tmp_path / "*")))
  assert len(source) == len(DOCS)
  assert [source[i] for i in (9, 0, 4, 22, 10)] == [DOCS[i] for i in (9, 0, 4, 22, 10)]
  assert list(text.iter_documents(str(tmp_path / "*"))) == DOCS


def test_clear_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="nothing_here"):
    text.make_text_dataset(str(tmp_path / "nothing_here*.jsonl"), CharTokenizer(), 8, 1, 0)
  (tmp_path / "x.csv").write_text("a")
  with pytest.raises(ValueError, match="unsupported file"):
    text.resolve_files(str(tmp_path / "x.csv"))
  (tmp_path / "bad.jsonl").write_text(json.dumps({"content": "a"}) + "\n")
  with pytest.raises(ValueError, match="no string field 'text'"):
    text.DocumentSource([str(tmp_path / "bad.jsonl")])[0]
  (tmp_path / "ok.txt").write_text("hello")
  for kwargs, match in [(dict(seq_len=1), "seq_len"), (dict(batch_size=0), "batch_size"),
                        (dict(shard_index=2, shard_count=2), "shard_index")]:
    args = dict(seq_len=8, batch_size=1, seed=0) | kwargs
    with pytest.raises(ValueError, match=match):
      text.make_text_dataset(str(tmp_path / "ok.txt"), CharTokenizer(), **args)
  with pytest.raises(ValueError, match="shard_count"):
    text.make_text_dataset(str(tmp_path / "ok.txt"), CharTokenizer(), 8, 1, 0, 1, 2)


def test_text_that_is_not_utf8_names_the_file_and_the_byte(tmp_path):
  (tmp_path / "a_good.txt").write_text("fine")
  (tmp_path / "b_latin1.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
  lines = [json.dumps({"text": "ok"}).encode(), b'{"text": "bad \xff"}']
  (tmp_path / "c.jsonl").write_bytes(b"\n".join(lines) + b"\n")
  source = text.DocumentSource(text.resolve_files(str(tmp_path / "*")))
  assert source[0] == "fine"
  with pytest.raises(text.DataError) as latin1:
    source[1]
  assert str(latin1.value) == (
      f"{tmp_path / 'b_latin1.txt'}: byte 3 (0xe9) is not UTF-8 (invalid continuation byte); "
      "text files must be UTF-8.")
  assert source[2] == "ok"
  # The offset counts from the start of the file, not of the line.
  offset = len(lines[0]) + 1 + lines[1].index(b"\xff")
  with pytest.raises(text.DataError, match=rf"c.jsonl: byte {offset} \(0xff\) is not UTF-8"):
    source[3]
  with pytest.raises(text.DataError, match="b_latin1.txt: byte 3"):
    text.require_text(str(tmp_path / "b_*.txt"), "--files")


def test_a_corpus_smaller_than_one_batch_is_refused_with_its_token_count(tmp_path):
  (tmp_path / "one.txt").write_text("x")
  (tmp_path / "two.txt").write_text("y" * 5)
  files = str(tmp_path / "*.txt")
  with pytest.raises(text.DataError) as small:
    text.require_one_batch(files, CharTokenizer(), 4, 3, "config.data.train_files")
  assert str(small.value) == (
      f"config.data.train_files={files!r} holds 8 tokens, fewer than one batch needs (3 rows "
      "of seq_len 4 = 12 tokens); give more text or a smaller batch_size or seq_len.")
  text.require_one_batch(files, CharTokenizer(), 4, 2, "config.data.train_files")
  with pytest.raises(text.DataError, match="holds 6 tokens for host 1 of 2, fewer"):
    text.require_one_batch(files, CharTokenizer(), 4, 2, "files", 1, 2)


def test_next_token_targets():
  tokens = np.asarray([[5, 6, 7, 8, 9, 1]])
  segments = np.asarray([[0, 0, 0, 1, 1, 2]])
  mask = np.asarray([[1, 1, 1, 1, 1, 0]])
  targets, weights = text.next_token_targets(tokens, segments, mask)
  np.testing.assert_array_equal(targets, [[6, 7, 8, 9, 1, 0]])
  np.testing.assert_array_equal(weights, [[1, 1, 0, 1, 0, 0]])
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  jt, jw = text.next_token_targets(jnp.asarray(tokens), jnp.asarray(segments))
  np.testing.assert_array_equal(jt, targets)
  np.testing.assert_array_equal(jw, [[1, 1, 0, 1, 0, 0]])
