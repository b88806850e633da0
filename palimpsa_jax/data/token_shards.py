"""Pre-tokenised text: token shards written by `python -m palimpsa_jax.data.prepare`, read by grain.

A prepared directory holds
  tokens_00000.npy, ...   the token stream, [n] uint16 (or uint32 for vocabularies over 65,536):
                          every document as [EOS] + tokens(text), documents one after another;
  tokenizer.json          the tokenizer that produced them;
  manifest.json           written last (a directory without it is incomplete): the tokenizer's
                          vocab_size and eos_id, the dtype, and each shard's file and token count.

Training reads the concatenated stream as rows of seq_len tokens: exactly the packing of the
on-the-fly pipeline (data/text.py), with segment ids restarting at every EOS and at every row
start. Rows are shuffled (a new permutation per epoch) and sharded per host; the iterator is
checkpointable like the other grain pipelines. Select the shards with `config.data.train_files=
'DIR/*.npy'` (and `eval_files` likewise).
"""

from __future__ import annotations

from collections.abc import Sequence
import filecmp
import json
import os
import shutil

import grain
import numpy as np

from palimpsa_jax.data import text as text_lib
from palimpsa_jax.data import tokenizer as tokenizer_lib

SHARD_SUFFIX = ".npy"
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)


def _patterns(files_glob: str | Sequence[str]) -> list[str]:
  if isinstance(files_glob, str):
    return [p.strip() for p in files_glob.split(",") if p.strip()]
  return list(files_glob)


def is_token_shards(files_glob: str | Sequence[str]) -> bool:
  """True if the glob(s) name token shards (*.npy); raises if shards and text files are mixed."""
  patterns = _patterns(files_glob)
  shards = [p.endswith(SHARD_SUFFIX) for p in patterns]
  if any(shards) and not all(shards):
    raise ValueError(f"files_glob {files_glob!r} mixes token shards ({SHARD_SUFFIX}) with text "
                     "files; prepare all of them, or none.")
  return bool(patterns) and all(shards)


def _directories(files_glob: str | Sequence[str]) -> list[tuple[str, dict, list[str]]]:
  """(directory, manifest, the shard paths selected there) per prepared directory."""
  selected: dict[str, list[str]] = {}
  for pattern in _patterns(files_glob):
    for path in text_lib.glob_files(pattern):
      selected.setdefault(os.path.dirname(os.path.abspath(path)), []).append(path)
  out = []
  for directory, paths in selected.items():
    manifest = read_manifest(directory)
    known = {shard["file"] for shard in manifest["shards"]}
    for path in paths:
      if os.path.basename(path) not in known:
        raise ValueError(f"{path!r} is not one of the shards listed in {directory}/{MANIFEST}")
    out.append((directory, manifest, sorted(set(paths))))
  return out


def read_manifest(directory: str) -> dict:
  """The manifest.json of a prepared directory; raises if it is missing (incomplete output)."""
  path = os.path.join(directory, MANIFEST)
  if not os.path.isfile(path):
    raise FileNotFoundError(
        f"{directory!r} has no {MANIFEST}: not a complete `python -m palimpsa_jax.data.prepare` "
        "output (rerun it).")
  with open(path) as f:
    return json.load(f)


def shard_tokenizer(files_glob: str | Sequence[str], spec: str,
                    workdir: str) -> tokenizer_lib.TextTokenizer:
  """The tokenizer the shards were prepared with, checked against config.data.tokenizer `spec`.

  With spec "bpe:<n>" (the default), the shards' tokenizer is copied to the workdir where a
  trained BPE would be kept, so eval.py finds it; a tokenizer.json spec must be the same file.

  Raises:
    ValueError: the directories were prepared with different tokenizers, or `spec` names
      another tokenizer.
  """
  tokenizers = [os.path.join(d, TOKENIZER) for d, _, _ in _directories(files_glob)]
  for other in tokenizers[1:]:
    if not filecmp.cmp(tokenizers[0], other, shallow=False):
      raise ValueError(f"token shards prepared with different tokenizers: {tokenizers[0]!r} "
                       f"and {other!r}")
  source = tokenizers[0]
  if spec.startswith("bpe:"):
    target = tokenizer_lib.bpe_tokenizer_path(workdir, int(spec.split(":", 1)[1]))
    if not os.path.isfile(target):
      os.makedirs(workdir, exist_ok=True)
      shutil.copyfile(source, target + ".tmp")
      os.replace(target + ".tmp", target)
    elif not filecmp.cmp(source, target, shallow=False):
      raise ValueError(f"{target!r} differs from the tokenizer of the token shards {source!r}: "
                       "this workdir was trained with another tokenizer.")
    return tokenizer_lib.load_tokenizer(target)
  if not filecmp.cmp(source, spec, shallow=False):
    raise ValueError(f"config.data.tokenizer={spec!r} is not the tokenizer the token shards were "
                     f"prepared with ({source!r}).")
  return tokenizer_lib.load_tokenizer(spec)


class TokenRows:
  """Rows of seq_len tokens over the concatenated shards (a grain data source).

  rows[i] -> {"tokens": [T] int32, "segment_ids": [T] int32, "mask": [T] int32}; with
  pad_last, a last partial row is padded (mask 0), else dropped.
  """

  def __init__(self, paths: Sequence[str], eos_id: int, seq_len: int, pad_last: bool):
    self._shards = [np.load(p, mmap_mode="r") for p in paths]
    self._starts = np.concatenate([[0], np.cumsum([len(s) for s in self._shards])])
    self._eos_id = eos_id
    self._seq_len = seq_len
    total = int(self._starts[-1])
    self._num_rows = -(-total // seq_len) if pad_last else total // seq_len

  def __len__(self) -> int:
    return self._num_rows

  def _slice(self, start: int, stop: int) -> np.ndarray:
    parts = []
    first = int(np.searchsorted(self._starts, start, side="right") - 1)
    for index in range(first, len(self._shards)):
      lo, hi = int(self._starts[index]), int(self._starts[index + 1])
      if lo >= stop:
        break
      parts.append(self._shards[index][max(start, lo) - lo:min(stop, hi) - lo])
    return np.concatenate(parts).astype(np.int32)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = int(index)
    if not 0 <= index < self._num_rows:
      raise IndexError(f"row {index} out of range [0, {self._num_rows})")
    start = index * self._seq_len
    tokens = self._slice(start, min(start + self._seq_len, int(self._starts[-1])))
    is_eos = tokens == self._eos_id
    segment_ids = np.cumsum(is_eos, dtype=np.int32) - np.int32(is_eos[0])
    mask = np.ones(self._seq_len, np.int32)
    missing = self._seq_len - len(tokens)
    if missing:  # Padding gets the id after the last document, like data/text.py.
      mask[len(tokens):] = 0
      tokens = np.concatenate([tokens, np.zeros(missing, np.int32)])
      segment_ids = np.concatenate(
          [segment_ids, np.full(missing, segment_ids[-1] + 1, np.int32)])
    return {"tokens": tokens, "segment_ids": segment_ids, "mask": mask}


def _rows(files_glob, seq_len: int, pad_last: bool, shard_index: int,
          shard_count: int) -> grain.MapDataset:
  directories = _directories(files_glob)
  eos_ids = {m["eos_id"] for _, m, _ in directories}
  if len(eos_ids) != 1:
    raise ValueError(f"token shards {files_glob!r} were prepared with different EOS ids {eos_ids}")
  paths = [p for _, _, ps in directories for p in ps]
  rows = TokenRows(paths, eos_ids.pop(), seq_len, pad_last)
  if len(rows) < shard_count:
    raise ValueError(f"token shards {files_glob!r} hold {len(rows)} rows of {seq_len} tokens, "
                     f"fewer than shard_count={shard_count}")
  return grain.MapDataset.source(rows)[int(shard_index)::int(shard_count)]


def require_one_batch(files_glob: str | Sequence[str], seq_len: int, batch_size: int, name: str,
                      shard_index: int = 0, shard_count: int = 1) -> None:
  """Raises DataError unless this host's rows of the shards fill one batch (batch_size rows of
  seq_len tokens; a last partial row does not count); `name` gave the files."""
  rows = len(_rows(files_glob, seq_len, False, shard_index, shard_count))
  if rows < batch_size:
    where = f" for host {shard_index} of {shard_count}" if shard_count > 1 else ""
    raise text_lib.DataError(
        f"{name}={files_glob!r} holds {rows * seq_len} tokens in whole rows{where}, fewer "
        f"than one batch needs ({batch_size} rows of seq_len {seq_len} = "
        f"{batch_size * seq_len} tokens); prepare more text or use a smaller batch_size or "
        "seq_len.")


def make_shard_dataset(files_glob: str | Sequence[str], seq_len: int, batch_size: int, seed: int,
                       shard_index: int = 0, shard_count: int = 1) -> grain.IterDataset:
  """Training batches {"tokens", "segment_ids"} [b, T] int32, rows shuffled per epoch, forever.

  Row i goes to host i % shard_count; a last partial row is dropped.
  """
  text_lib.validate_batching(seq_len, batch_size, shard_index, shard_count)
  rows = _rows(files_glob, seq_len, False, shard_index, shard_count)
  rows = rows.shuffle(seed=seed).repeat(None).map(
      lambda row: {"tokens": row["tokens"], "segment_ids": row["segment_ids"]})
  return rows.batch(int(batch_size), drop_remainder=True).to_iter_dataset(_READ_OPTIONS)


def make_shard_eval_dataset(files_glob: str | Sequence[str], seq_len: int, batch_size: int,
                            shard_index: int = 0, shard_count: int = 1) -> grain.IterDataset:
  """One ordered pass: {"tokens", "segment_ids", "mask"} [b, T] int32, the last row padded and
  the last batch filled with empty rows (mask 0), as make_text_eval_dataset does."""
  text_lib.validate_batching(seq_len, batch_size, shard_index, shard_count)
  rows = _rows(files_glob, seq_len, True, shard_index, shard_count)
  batch_size = int(batch_size)
  batches = rows.batch(batch_size, batch_fn=lambda r: text_lib.stack_and_pad(r, batch_size))
  return batches.to_iter_dataset(_READ_OPTIONS)
