"""Tokenizers: load a tokenizer.json, or train a byte-level BPE on the training files.

Needs the HuggingFace `tokenizers` package.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import tempfile
from collections.abc import Iterator, Sequence

import numpy as np
import tokenizers

from palimpsa_jax.data import text as text_lib

EOS_TOKEN = "<|endoftext|>"
# End-of-sequence tokens of common tokenizer.json files, in the order they are looked for.
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[SEP]")
_BPE_SPEC = re.compile(r"^bpe:(\d+)$")
_BYTE_FALLBACK = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
DEFAULT_MAX_TRAIN_BYTES = 1 << 30


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
  """Inverse of the byte-level alphabet: printable character -> byte value (GPT-2's mapping)."""
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) +
               list(range(ord("®"), ord("ÿ") + 1)))
  chars = list(printable)
  extra = 0
  for b in range(256):
    if b not in printable:
      printable.append(b)
      chars.append(256 + extra)
      extra += 1
  return {chr(c): b for b, c in zip(printable, chars)}


def _uses_byte_level(component) -> bool:
  if not component:
    return False
  if component.get("type") == "ByteLevel":
    return True
  return any(_uses_byte_level(c) for c in component.get("decoders", []) or [])


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
  """A HuggingFace `tokenizers.Tokenizer` with its end-of-sequence id.

  Attributes:
    hf: the underlying tokenizers.Tokenizer.
    eos_id: id of the end-of-sequence token (also the start-of-document token of the pipeline).
    path: the tokenizer.json it was loaded from.
  """

  hf: object
  eos_id: int
  path: str

  @property
  def vocab_size(self) -> int:
    return self.hf.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    """Token ids of text, without special tokens added."""
    return self.hf.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Sequence[int]) -> str:
    return self.hf.decode([int(i) for i in ids], skip_special_tokens=True)

  @functools.cached_property
  def token_bytes(self) -> np.ndarray:
    """UTF-8 bytes each token stands for: [vocab_size] int64; 0 for special tokens."""
    spec = json.loads(self.hf.to_str())
    byte_level = _uses_byte_level(spec.get("decoder")) or _uses_byte_level(spec.get("pre_tokenizer"))
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    decoder = _byte_level_decoder()
    lengths = np.zeros(self.vocab_size, np.int64)
    for token, index in self.hf.get_vocab(with_added_tokens=True).items():
      if index in special:
        continue
      if byte_level and all(c in decoder for c in token):
        lengths[index] = len(token)
      elif _BYTE_FALLBACK.match(token):
        lengths[index] = 1
      else:
        lengths[index] = len(token.replace("\u2581", " ").encode("utf-8"))
    return lengths


def _find_eos(hf, path: str) -> int:
  for name in _EOS_CANDIDATES:
    index = hf.token_to_id(name)
    if index is not None:
      return index
  raise ValueError(f"tokenizer {path!r} has none of the end-of-sequence tokens "
                   f"{', '.join(_EOS_CANDIDATES)}")


def load_tokenizer(path: str) -> TextTokenizer:
  """Loads a tokenizer.json file."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"tokenizer file {path!r} does not exist")
  hf = tokenizers.Tokenizer.from_file(path)
  return TextTokenizer(hf=hf, eos_id=_find_eos(hf, path), path=path)


def _limited(texts: Iterator[str], max_bytes: int) -> Iterator[str]:
  seen = 0
  for text in texts:
    if seen >= max_bytes:
      return
    seen += len(text.encode("utf-8"))
    yield text


def train_bpe_tokenizer(texts: Iterator[str], vocab_size: int, path: str) -> TextTokenizer:
  """Trains a byte-level BPE with EOS_TOKEN as its only special token (id 0); saves it to path."""
  tk = tokenizers
  if vocab_size < 258:
    raise ValueError(f"vocab_size must be >= 258 (256 bytes + EOS + 1 merge), got {vocab_size}")
  hf = tk.Tokenizer(tk.models.BPE())
  hf.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.decoder = tk.decoders.ByteLevel()
  trainer = tk.trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
      initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
  hf.train_from_iterator(texts, trainer=trainer)
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  # Write then rename, so that concurrent readers never see a partial file.
  with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as f:
    f.write(hf.to_str())
  umask = os.umask(0)  # a temporary file is private (0600); the tokenizer is not
  os.umask(umask)
  os.chmod(f.name, 0o666 & ~umask)
  os.replace(f.name, path)
  return TextTokenizer(hf=hf, eos_id=hf.token_to_id(EOS_TOKEN), path=path)


def bpe_vocab_size(spec: str) -> int | None:
  """N of a "bpe:N" tokenizer spec; None for a tokenizer.json path."""
  match = _BPE_SPEC.match(spec) if isinstance(spec, str) else None
  return int(match.group(1)) if match else None


def bpe_tokenizer_path(workdir: str, vocab_size: int) -> str:
  """Where load_or_train_tokenizer keeps a trained BPE of vocab_size in workdir."""
  return os.path.join(workdir, f"tokenizer_bpe{vocab_size}.json")


def find_tokenizer_file(spec: str, folder: str) -> str:
  """The tokenizer.json file of a run's tokenizer `spec`: the path itself, or for "bpe:<n>" the
  BPE that training kept in `folder` or one of its parents (the workdir of a
  checkpoints/<step> folder).

  Raises:
    FileNotFoundError: no such file, naming what was looked for.
  """
  vocab_size = bpe_vocab_size(spec)
  if vocab_size is None:
    if not os.path.isfile(spec):
      raise FileNotFoundError(f"tokenizer file {spec!r} does not exist")
    return spec
  directory = os.path.abspath(folder)
  for _ in range(4):
    path = bpe_tokenizer_path(directory, vocab_size)
    if os.path.isfile(path):
      return path
    directory = os.path.dirname(directory)
  raise FileNotFoundError(f"{folder!r} was trained with tokenizer {spec!r} but no "
                          f"{os.path.basename(path)} is in it or its parent folders")


def load_or_train_tokenizer(spec: str, train_files: str | Sequence[str] | None,
                            workdir: str | None, *,
                            max_train_bytes: int = DEFAULT_MAX_TRAIN_BYTES) -> TextTokenizer:
  """Returns the tokenizer described by spec.

  Args:
    spec: a tokenizer.json path, or "bpe:<vocab_size>" for a byte-level BPE trained on the first
      max_train_bytes of the training documents and kept in workdir (reused when already there).
    train_files: glob of the training files (only needed to train a BPE).
    workdir: where a trained BPE is saved.
    max_train_bytes: cap on the text used to train a BPE.
  """
  if not isinstance(spec, str) or not spec:
    raise ValueError(f"tokenizer spec must be a tokenizer.json path or 'bpe:<vocab_size>', "
                     f"got {spec!r}")
  match = _BPE_SPEC.match(spec)
  if match is None:
    if spec.startswith("bpe:"):
      raise ValueError(f"tokenizer spec {spec!r}: expected 'bpe:<vocab_size>' with an integer")
    return load_tokenizer(spec)
  vocab_size = int(match.group(1))
  if workdir is None:
    raise ValueError(f"tokenizer spec {spec!r} needs a workdir to keep the trained tokenizer")
  path = bpe_tokenizer_path(workdir, vocab_size)
  if os.path.isfile(path):
    return load_tokenizer(path)
  if train_files is None:
    raise FileNotFoundError(f"no trained tokenizer at {path!r} and no train_files to train "
                            f"one for spec {spec!r}")
  return train_bpe_tokenizer(_limited(text_lib.iter_documents(train_files), max_train_bytes),
                             vocab_size, path)
