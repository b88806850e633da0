"""Text pipeline: local documents -> tokens -> packed rows with segment ids (grain).

Documents come from local files matched by a glob (several globs may be joined with commas):
  .txt, .md               one document per file;
  .jsonl                  one document per line, its "text" field;
  .parquet                one document per row, its "text" column (needs pyarrow);
  .array_record / .arrayrecord   one document per record, UTF-8 text (needs array_record).

Every document is tokenised as [EOS] + tokens(text): the EOS separates documents and serves as the
start-of-document token, so a model always sees EOS before a document's first token (the
lm-eval adapter conditions on it too). The token stream is concatenated and cut into rows of
seq_len. segment_ids number the documents within a row from 0; a document continuing from the
previous row gets a new segment id in its new row (the recurrent state restarts there).

Text must be UTF-8: a file that is not is refused in one line naming it and the byte offset of
the first invalid byte (`decode_utf8`).

Next-token targets: position t predicts tokens[t + 1] only where segment_ids[t + 1] ==
segment_ids[t] (see `next_token_targets`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import glob as glob_lib
import json
import os
from typing import Any, Protocol

import grain
import jax.numpy as jnp
import numpy as np

from palimpsa_jax import user_errors

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)
ARRAY_RECORD_SUFFIXES = (".array_record", ".arrayrecord")
_ALL_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES + ARRAY_RECORD_SUFFIXES
_SCAN_CHUNK_BYTES = 1 << 26


class Tokenizer(Protocol):
  """What the pipeline needs from a tokenizer (see palimpsa_jax.data.tokenizer)."""

  eos_id: int

  def encode(self, text: str) -> list[int]:
    ...


class DataError(ValueError, user_errors.UserError):
  """Data that cannot be trained or evaluated on (e.g. files without any text)."""


def decode_utf8(data: bytes, path: str, offset: int = 0) -> str:
  """`data` (read from `path` at byte `offset`) as text.

  Raises:
    DataError: `data` is not UTF-8; names `path` and the file's offset of the first bad byte.
  """
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as error:
    raise DataError(
        f"{path}: byte {offset + error.start} (0x{data[error.start]:02x}) is not UTF-8 "
        f"({error.reason}); text files must be UTF-8.") from None


def read_text_file(path: str) -> str:
  """The whole file as text; raises DataError if it is not UTF-8 (see decode_utf8)."""
  with open(path, "rb") as f:
    return decode_utf8(f.read(), path)


def resolve_files(files_glob: str | Sequence[str]) -> list[str]:
  """Expands a glob (or comma-separated globs, or a list of them) into sorted file paths.

  Raises:
    FileNotFoundError: a glob matches no file.
    DataError: the glob is empty, or a matched file has an unsupported suffix.
  """
  if isinstance(files_glob, str):
    patterns = [p.strip() for p in files_glob.split(",") if p.strip()]
  else:
    patterns = list(files_glob)
  if not patterns:
    raise DataError(f"files_glob is empty: {files_glob!r}")
  files = []
  for pattern in patterns:
    files.extend(glob_files(pattern))
  for path in files:
    if not path.endswith(_ALL_SUFFIXES):
      raise DataError(
          f"unsupported file {path!r}: expected one of the suffixes {', '.join(_ALL_SUFFIXES)}")
  return files


def require_text(files_glob: str | Sequence[str], name: str) -> list[str]:
  """The files of `files_glob` (see resolve_files), if one of their documents holds text.

  Reads documents up to the first that is not blank (in a usable corpus, the first).

  Raises:
    DataError: a glob matches no file, or every document is empty or blank; the message
      names `name` (the flag or config field that gave the files).
  """
  try:
    files = resolve_files(files_glob)
  except FileNotFoundError as missing:
    raise DataError(f"{name}={files_glob!r}: {missing}") from None
  if not any(document.strip() for document in DocumentSource(files)):
    raise DataError(f"{name}={files_glob!r}: the {len(files)} matched file(s) hold no text "
                    "(every document is empty).")
  return files


def glob_files(pattern: str) -> list[str]:
  """The files one glob matches, sorted; raises FileNotFoundError if none."""
  matched = sorted(p for p in glob_lib.glob(os.path.expanduser(pattern), recursive=True)
                   if os.path.isfile(p))
  if not matched:
    raise FileNotFoundError(f"files_glob {pattern!r} matched no files")
  return matched


def _jsonl_line_offsets(path: str) -> np.ndarray:
  """Start offsets of the non-empty lines of a JSONL file, then the file size: [n_lines + 1]."""
  starts = [np.zeros(1, np.int64)]
  with open(path, "rb") as f:
    base = 0
    while chunk := f.read(_SCAN_CHUNK_BYTES):
      newlines = np.flatnonzero(np.frombuffer(chunk, np.uint8) == ord("\n"))
      starts.append(base + newlines.astype(np.int64) + 1)
      base += len(chunk)
  bounds = np.unique(np.concatenate(starts + [np.asarray([base], np.int64)]))
  # A JSON object takes at least 2 bytes ("{}"): shorter lines are blank.
  nonempty = bounds[:-1][np.diff(bounds) >= 2]
  return np.concatenate([nonempty, [base]]).astype(np.int64)


class _TextFile:
  """A .txt file: one document."""

  def __init__(self, path: str):
    self.path = path

  def __len__(self) -> int:
    return 1

  def __getitem__(self, index: int) -> str:
    return read_text_file(self.path)


class _JsonlFile:
  """A .jsonl file: one document per non-blank line, its "text" field."""

  def __init__(self, path: str):
    self.path = path
    self._offsets = _jsonl_line_offsets(path)

  def __len__(self) -> int:
    return len(self._offsets) - 1

  def __getitem__(self, index: int) -> str:
    start, stop = int(self._offsets[index]), int(self._offsets[index + 1])
    with open(self.path, "rb") as f:
      f.seek(start)
      line = f.read(stop - start)
    try:
      record = json.loads(decode_utf8(line, self.path, start))
    except json.JSONDecodeError as e:
      raise DataError(f"{self.path}: line at byte {start} is not valid JSON: {e}") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
      raise DataError(f"{self.path}: line at byte {start} has no string field 'text'")
    return record["text"]


class _ParquetFile:
  """A .parquet file: one document per row of its "text" column; caches one row group."""

  def __init__(self, path: str):
    try:
      # Deferred: pyarrow is optional (the eval extra) and only .parquet files need it.
      import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError(
          f"reading {path!r} needs pyarrow: pip install pyarrow (or palimpsa-jax[eval])") from e
    self.path = path
    self._file = pq.ParquetFile(path)
    if "text" not in self._file.schema_arrow.names:
      raise ValueError(f"{path}: parquet file has no 'text' column "
                       f"(columns: {self._file.schema_arrow.names})")
    rows = [self._file.metadata.row_group(i).num_rows for i in range(self._file.num_row_groups)]
    self._group_starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    self._cached_group = -1
    self._cached_texts: list[str] = []

  def __len__(self) -> int:
    return int(self._group_starts[-1])

  def __getitem__(self, index: int) -> str:
    group = int(np.searchsorted(self._group_starts, index, side="right") - 1)
    if group != self._cached_group:
      table = self._file.read_row_group(group, columns=["text"])
      self._cached_texts = table.column("text").to_pylist()
      self._cached_group = group
    return self._cached_texts[index - int(self._group_starts[group])]


class _ArrayRecordFile:
  """An ArrayRecord file: one UTF-8 document per record."""

  def __init__(self, path: str):
    self.path = path
    self._source = grain.sources.ArrayRecordDataSource([path])

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> str:
    record = bytes(self._source[index])
    try:
      return record.decode("utf-8")
    except UnicodeDecodeError as error:
      raise DataError(f"{self.path}: record {index}: byte {error.start} "
                      f"(0x{record[error.start]:02x}) is not UTF-8 ({error.reason}); text "
                      "must be UTF-8.") from None


def _open_file(path: str):
  if path.endswith(TEXT_SUFFIXES):
    return _TextFile(path)
  if path.endswith(JSONL_SUFFIXES):
    return _JsonlFile(path)
  if path.endswith(PARQUET_SUFFIXES):
    return _ParquetFile(path)
  return _ArrayRecordFile(path)


class DocumentSource:
  """Random access to the documents of several files (a grain data source).

  source[i] -> str, documents numbered file after file in sorted path order.
  """

  def __init__(self, files: Sequence[str]):
    self.files = list(files)
    self._readers = [_open_file(p) for p in self.files]
    counts = [len(r) for r in self._readers]
    self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

  def __len__(self) -> int:
    return int(self._starts[-1])

  def __getitem__(self, index: int) -> str:
    index = int(index)
    if not 0 <= index < len(self):
      raise IndexError(f"document index {index} out of range [0, {len(self)})")
    file_index = int(np.searchsorted(self._starts, index, side="right") - 1)
    return self._readers[file_index][index - int(self._starts[file_index])]

  def __iter__(self) -> Iterator[str]:
    for reader in self._readers:
      for i in range(len(reader)):
        yield reader[i]


def iter_documents(files_glob: str | Sequence[str]) -> Iterator[str]:
  """Yields the documents of the matched files in order."""
  yield from DocumentSource(resolve_files(files_glob))


class _TokenizeDocument(grain.transforms.Map):
  """text -> {"tokens": [EOS] + tokens(text)} as int32 [n]."""

  def __init__(self, tokenizer: Tokenizer):
    self._tokenizer = tokenizer

  def map(self, text: str) -> dict[str, np.ndarray]:
    ids = self._tokenizer.encode(text)
    return {"tokens": np.asarray([self._tokenizer.eos_id, *ids], np.int32)}


def _zero_based_rows(packed: dict[str, Any]) -> dict[str, np.ndarray]:
  """Turns ConcatThenSplit's output into tokens, 0-based segment ids and a mask.

  ConcatThenSplit numbers segments from 1 and marks padding with 0; padding gets the id after the
  row's last document so that it never continues a real document.
  """
  tokens = np.asarray(packed["tokens"], np.int32)
  raw = np.asarray(packed["tokens_segment_ids"], np.int32)
  mask = (raw > 0).astype(np.int32)
  segment_ids = np.where(raw > 0, raw - 1, raw.max(initial=0)).astype(np.int32)
  return {"tokens": tokens, "segment_ids": segment_ids, "mask": mask}


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def validate_batching(seq_len: int, batch_size: int, shard_index: int, shard_count: int) -> None:
  """Raises ValueError naming the first bad row length, batch size or host shard."""
  if not _is_int(seq_len) or seq_len < 2:
    raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")
  if not _is_int(batch_size) or batch_size < 1:
    raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
  if not _is_int(shard_count) or shard_count < 1:
    raise ValueError(f"shard_count must be an int >= 1, got {shard_count!r}")
  if not _is_int(shard_index) or not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index must be an int in [0, shard_count={shard_count}), "
                     f"got {shard_index!r}")


def _packed_rows(documents: grain.MapDataset, tokenizer: Tokenizer, seq_len: int,
                 num_threads: int) -> grain.IterDataset:
  seq_len = int(seq_len)
  tokenized = documents.map(_TokenizeDocument(tokenizer)).to_iter_dataset(
      grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=4 * max(num_threads, 1)))
  packed = grain.experimental.ConcatThenSplitIterDataset(
      tokenized, length_struct={"tokens": seq_len}, split_full_length_features=True)
  return packed.map(_zero_based_rows)


def _shard(files_glob, shard_index: int, shard_count: int) -> grain.MapDataset:
  source = DocumentSource(resolve_files(files_glob))
  if len(source) < shard_count:
    raise DataError(f"files_glob {files_glob!r} holds {len(source)} documents, fewer than "
                    f"shard_count={shard_count}")
  return grain.MapDataset.source(source)[int(shard_index)::int(shard_count)]


def require_one_batch(files_glob: str | Sequence[str], tokenizer: Tokenizer, seq_len: int,
                      batch_size: int, name: str, shard_index: int = 0,
                      shard_count: int = 1) -> None:
  """Raises DataError unless this host's documents hold one batch: batch_size * seq_len tokens.

  Tokenises documents only until that many are counted (a usable corpus: its first ones).
  Without this check a tiny corpus would be repeated to fill every row. `name` is the flag or
  config field that gave the files.
  """
  needed = int(batch_size) * int(seq_len)
  held = 0
  for text in _shard(files_glob, shard_index, shard_count):
    held += len(tokenizer.encode(text)) + 1  # [EOS] + tokens(text)
    if held >= needed:
      return
  where = f" for host {shard_index} of {shard_count}" if shard_count > 1 else ""
  raise DataError(
      f"{name}={files_glob!r} holds {held} tokens{where}, fewer than one batch needs "
      f"({batch_size} rows of seq_len {seq_len} = {needed} tokens); give more text or a "
      "smaller batch_size or seq_len.")


def make_text_dataset(files_glob: str | Sequence[str], tokenizer: Tokenizer, seq_len: int,
                      batch_size: int, seed: int, shard_index: int = 0, shard_count: int = 1,
                      *, num_threads: int = 4) -> grain.IterDataset:
  """Training batches of packed documents, shuffled per epoch, repeated forever.

  Documents are sharded per host (document i goes to host i % shard_count), shuffled globally
  with `seed` (a new permutation each epoch), tokenised, concatenated and cut into rows.

  Args:
    files_glob: glob (or comma-separated globs) of local .txt/.jsonl/.parquet/ArrayRecord files.
    tokenizer: has `eos_id` and `encode(text) -> list[int]`.
    seq_len: row length T.
    batch_size: rows per batch on this host b.
    seed: shuffle seed; the same seed gives the same batches.
    shard_index, shard_count: this host's shard.
    num_threads: threads reading and tokenising documents (order is kept).

  Returns:
    A grain IterDataset; `iter(ds)` gives a checkpointable iterator (get_state/set_state) of
    {"tokens": [b, T] int32, "segment_ids": [b, T] int32}.
  """
  validate_batching(seq_len, batch_size, shard_index, shard_count)
  documents = _shard(files_glob, shard_index, shard_count).shuffle(seed=seed).repeat(None)
  rows = _packed_rows(documents, tokenizer, seq_len, num_threads)
  rows = rows.map(lambda row: {"tokens": row["tokens"], "segment_ids": row["segment_ids"]})
  return rows.batch(int(batch_size), drop_remainder=True)


def stack_and_pad(rows: Sequence[dict[str, np.ndarray]], batch_size: int) -> dict[str, np.ndarray]:
  """Stacks rows into a batch, adding empty rows (mask 0) up to batch_size."""
  batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
  missing = batch_size - len(rows)
  if missing:
    batch = {k: np.concatenate([v, np.zeros((missing,) + v.shape[1:], v.dtype)])
             for k, v in batch.items()}
  return batch


def make_text_eval_dataset(files_glob: str | Sequence[str], tokenizer: Tokenizer, seq_len: int,
                           batch_size: int, shard_index: int = 0, shard_count: int = 1,
                           *, num_threads: int = 4) -> grain.IterDataset:
  """One ordered pass over held-out documents, packed exactly as in training.

  The last row is padded and the last batch filled with empty rows, so every batch has the same
  shape; "mask" marks real tokens.

  Returns:
    A grain IterDataset of {"tokens": [b, T] int32, "segment_ids": [b, T] int32,
    "mask": [b, T] int32 (1 = real token, 0 = padding)}.
  """
  validate_batching(seq_len, batch_size, shard_index, shard_count)
  rows = _packed_rows(_shard(files_glob, shard_index, shard_count), tokenizer, seq_len,
                      num_threads)
  batch_size = int(batch_size)
  return rows.batch(batch_size, batch_fn=lambda rows: stack_and_pad(rows, batch_size))


def next_token_targets(tokens, segment_ids, mask=None):
  """Next-token targets and weights for packed rows (numpy or jax arrays).

  Args:
    tokens: [B, T] int.
    segment_ids: [B, T] int.
    mask: optional [B, T], 1 for real tokens.

  Returns:
    targets [B, T] (tokens shifted left by one, 0 at the last position) and weights [B, T] in
    {0, 1}: 1 where position t predicts a real token t + 1 of the same segment.
  """
  xp = np if isinstance(tokens, np.ndarray) else jnp
  targets = xp.concatenate([tokens[:, 1:], xp.zeros_like(tokens[:, :1])], axis=1)
  same = segment_ids[:, 1:] == segment_ids[:, :-1]
  if mask is not None:
    same = same & (mask[:, 1:] > 0)
  weights = xp.concatenate([same, xp.zeros_like(same[:, :1])], axis=1).astype(xp.float32)
  return targets, weights

