"""Tokenises text files once into token shards for training (data/token_shards.py).

  python -m palimpsa_jax.data.prepare --files 'data/train/*.jsonl' --tokenizer bpe:32000 \
      --output data/tokens/train
  python -m palimpsa_jax.data.prepare --files 'data/valid/*.jsonl' \
      --tokenizer data/tokens/train/tokenizer.json --output data/tokens/valid
  python train.py --config configs/lm.py:model=palimpsa_d,size=170m --workdir runs/lm \
      --config.data.train_files='data/tokens/train/*.npy' \
      --config.data.eval_files='data/tokens/valid/*.npy'

--tokenizer is a tokenizer.json, or bpe:<vocab> to train a byte-level BPE on the files first (as
train.py would). Documents keep the files' order (training shuffles rows); every document is
[EOS] + tokens(text), as in data/text.py. Tokenising runs on every core (the tokenizer's batch
encoder). A progress line goes to stderr; manifest.json is written last, so an interrupted run
leaves a directory that training refuses and a rerun replaces.
"""

import argparse
import json
import os
import sys
import time
from typing import TextIO

import numpy as np

from palimpsa_jax import user_errors
from palimpsa_jax.data import text as text_lib
from palimpsa_jax.data import token_shards
from palimpsa_jax.data import tokenizer as tokenizer_lib

PROGRAM = "prepare"  # The prefix of its one-line errors.
DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB shards of uint16.
_DOCUMENTS_PER_BATCH = 256


def _duration(seconds: float) -> str:
  minutes, seconds = divmod(int(max(seconds, 0)), 60)
  return f"{minutes}:{seconds:02d}"


def _tokenizer(spec: str, files: list[str], output: str) -> tokenizer_lib.TextTokenizer:
  """The tokenizer for spec, saved as output/tokenizer.json."""
  target = os.path.join(output, token_shards.TOKENIZER)
  if spec.startswith("bpe:"):
    trained = tokenizer_lib.load_or_train_tokenizer(spec, files, output)
    os.replace(trained.path, target)
  else:
    loaded = tokenizer_lib.load_tokenizer(spec)
    with open(target, "w") as f:
      f.write(loaded.hf.to_str())
  return tokenizer_lib.load_tokenizer(target)


def _write_shard(output: str, index: int, tokens: list[np.ndarray], dtype) -> dict:
  name = f"tokens_{index:05d}{token_shards.SHARD_SUFFIX}"
  array = np.concatenate(tokens).astype(dtype)
  temporary = os.path.join(output, name + ".tmp")
  with open(temporary, "wb") as f:
    np.save(f, array)
  os.replace(temporary, os.path.join(output, name))
  return {"file": name, "tokens": int(len(array))}


def prepare(files_glob: str, tokenizer_spec: str, output: str, *,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, progress: TextIO = sys.stderr) -> dict:
  """Writes output/{tokens_*.npy, tokenizer.json, manifest.json}; returns the manifest.

  Raises:
    FileExistsError: output already holds a complete preparation.
    text_lib.DataError: shard_tokens < 1, or the files are not text (text_lib.require_text).
  """
  if shard_tokens < 1:
    raise text_lib.DataError(f"--shard_tokens must be >= 1, got {shard_tokens}")
  if os.path.isfile(os.path.join(output, token_shards.MANIFEST)):
    raise FileExistsError(f"{output!r} already holds prepared tokens ({token_shards.MANIFEST}); "
                          "delete it or choose another --output.")
  files = text_lib.require_text(files_glob, "--files")
  os.makedirs(output, exist_ok=True)
  for name in os.listdir(output):  # Left by an interrupted run.
    if name.startswith("tokens_"):
      os.remove(os.path.join(output, name))
  start = time.perf_counter()
  tokenizer = _tokenizer(tokenizer_spec, files, output)
  dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
  source = text_lib.DocumentSource(files)
  total_documents = len(source)
  if not total_documents:
    raise text_lib.DataError(f"--files {files_glob!r} hold no documents")

  shards, pending, pending_tokens, documents, tokens_done = [], [], 0, 0, 0
  encode_start, last_report = time.perf_counter(), 0.0
  texts = iter(source)
  while batch := [t for _, t in zip(range(_DOCUMENTS_PER_BATCH), texts)]:
    for ids in tokenizer.encode_batch(batch):
      pending.append(np.asarray([tokenizer.eos_id, *ids], dtype))
      pending_tokens += len(ids) + 1
    documents += len(batch)
    while pending_tokens >= shard_tokens:
      stream = np.concatenate(pending)
      shards.append(_write_shard(output, len(shards), [stream[:shard_tokens]], dtype))
      pending, pending_tokens = [stream[shard_tokens:]], len(stream) - shard_tokens
    tokens_done = sum(s["tokens"] for s in shards) + pending_tokens
    now = time.perf_counter()
    if now - last_report > 0.5 or documents == total_documents:
      rate = tokens_done / max(now - encode_start, 1e-9)
      eta = (total_documents - documents) * (now - encode_start) / documents
      progress.write(f"\rprepare: {documents:,}/{total_documents:,} documents "
                     f"({100 * documents / total_documents:.0f}%), {tokens_done:,} tokens, "
                     f"{rate:,.0f} tokens/s, ETA {_duration(eta)}")
      progress.flush()
      last_report = now
  if pending_tokens:
    shards.append(_write_shard(output, len(shards), pending, dtype))
  manifest = {
      "tokenizer": token_shards.TOKENIZER, "vocab_size": tokenizer.vocab_size,
      "eos_id": tokenizer.eos_id, "dtype": np.dtype(dtype).name,
      "num_documents": documents, "num_tokens": tokens_done, "shards": shards,
      "files": files_glob, "seconds": time.perf_counter() - start,
  }
  temporary = os.path.join(output, token_shards.MANIFEST + ".tmp")
  with open(temporary, "w") as f:
    json.dump(manifest, f, indent=2)
  os.replace(temporary, os.path.join(output, token_shards.MANIFEST))
  progress.write(f"\nprepare: wrote {tokens_done:,} tokens of {documents:,} documents in "
                 f"{len(shards)} shard(s) to {output} ({manifest['seconds']:.1f} s)\n")
  return manifest


def main(argv: list[str] | None = None) -> dict:
  """The command line; a refused input or argument is one line on stderr (exit status 1)."""
  argv = sys.argv[1:] if argv is None else argv
  return user_errors.one_line(PROGRAM, _main, verbose=lambda: user_errors.wants_traceback(argv))(
      argv)


def _main(argv: list[str]) -> dict:
  parser = user_errors.ArgumentParser(prog="python -m palimpsa_jax.data.prepare",
                                      description=__doc__.split("\n", 1)[0])
  parser.add_argument("--files", required=True,
                      help="glob(s) of .txt/.jsonl/.parquet/ArrayRecord files, comma-separated")
  parser.add_argument("--tokenizer", required=True,
                      help="a tokenizer.json, or bpe:<vocab> to train one on the files")
  parser.add_argument("--output", required=True, help="directory for the shards")
  parser.add_argument("--shard_tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                      help="tokens per shard file")
  parser.add_argument("--verbose", action="store_true",
                      help="show the traceback of a refused input")
  args = parser.parse_args(argv)
  return prepare(args.files, args.tokenizer, args.output, shard_tokens=args.shard_tokens)


if __name__ == "__main__":
  main()
