"""Sampling text from a language-model checkpoint, streamed as it is decoded (generate.py).

A prompt is tokenised as [EOS] + tokens(prompt), as every training document is
(palimpsa_jax.data.text): EOS is also the start-of-document token, so an empty
prompt samples a document from its start. A sample ends at the first EOS it
generates or after max_new_tokens. Decoding runs models.decoding.stream: the
recurrent O(1)-state step of the recurrent mixers, a KV cache for attention.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import time
import unicodedata

import numpy as np

from palimpsa_jax import user_errors
from palimpsa_jax.data import text as text_lib
from palimpsa_jax.data import tokenizer as tokenizer_lib
from palimpsa_jax.models import decoding
from palimpsa_jax.run_config import values


# What each sampling setting accepts (generate.py checks its flags of these names with them).
SAMPLING_FIELDS = {
    "max_new_tokens": values.positive(128),
    "temperature": values.at_least(0, 1.0, float),  # 0: greedy.
    "top_k": values.at_least(0, 0),  # 0: every token.
    "top_p": values.in_interval(0, 1, 1.0, low_closed=False),  # 1: every token.
    "seed": values.anything(0, int),
    "num_samples": values.positive(1),
}


class SamplingError(ValueError, user_errors.UserError):
  """A sampling setting out of its range (SAMPLING_FIELDS)."""


@dataclasses.dataclass(frozen=True)
class Sampling:
  """Sampling settings (see models.decoding.sample_token); temperature 0 is greedy."""
  max_new_tokens: int = SAMPLING_FIELDS["max_new_tokens"].default
  temperature: float = SAMPLING_FIELDS["temperature"].default
  top_k: int = SAMPLING_FIELDS["top_k"].default
  top_p: float = SAMPLING_FIELDS["top_p"].default
  seed: int = SAMPLING_FIELDS["seed"].default
  num_samples: int = SAMPLING_FIELDS["num_samples"].default

  def __post_init__(self):
    for name, field in SAMPLING_FIELDS.items():
      if not field.accepts(getattr(self, name)):
        raise SamplingError(f"{name} must be {field.expected}, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class Timing:
  """One prompt's decoding, over all its samples (EOS included, nothing after it).

  first_token_s: from the start to the first token of each sample (the prefill, and
  compilation on first use); rest_tokens: the tokens after those, in rest_s seconds.
  """
  prompt_tokens: int
  new_tokens: int
  first_token_s: float
  rest_tokens: int
  rest_s: float


def prompt_ids(tokenizer: tokenizer_lib.TextTokenizer, prompt: str) -> list[int]:
  """[EOS] + tokens(prompt), as training sees the start of a document."""
  return [tokenizer.eos_id, *tokenizer.encode(prompt)]


def read_prompt_file(path: str) -> list[str]:
  """The non-empty lines of a UTF-8 text file, one prompt each.

  Raises:
    text_lib.DataError: the file is not UTF-8 (naming the byte offset) or holds no prompt.
  """
  text = text_lib.read_text_file(path).replace("\r\n", "\n").replace("\r", "\n")
  prompts = [line for line in text.split("\n") if line.strip()]
  if not prompts:
    raise text_lib.DataError(
        f"--prompt_file {path!r} holds no prompt (one per non-empty line)")
  return prompts


def printable(text: str) -> str:
  """`text` with its control characters (BEL, backspace, ESC, carriage return, ...) written as
  escapes such as \\x07, so that a sample cannot act on the terminal; newlines and tabs stay."""
  return "".join(
      f"\\x{ord(c):02x}" if unicodedata.category(c) == "Cc" and c not in "\n\t" else c
      for c in text)


class TextStream:
  """Turns a growing list of token ids into text increments.

  A byte-level token can end inside a multi-byte character; such a tail
  (decoded as U+FFFD) is held back until the character is complete.
  """

  def __init__(self, tokenizer: tokenizer_lib.TextTokenizer):
    self._tokenizer = tokenizer
    self._ids: list[int] = []
    self._shown = 0

  def add(self, token: int) -> str:
    """Appends a token; returns the text that is now complete and not yet returned."""
    self._ids.append(int(token))
    text = self._tokenizer.decode(self._ids)
    if text.endswith("\ufffd"):
      return ""
    return self._new_part(text)

  def flush(self) -> str:
    """The text not yet returned, an incomplete last character included."""
    return self._new_part(self._tokenizer.decode(self._ids))

  def _new_part(self, text: str) -> str:
    new, self._shown = text[self._shown:], len(text)
    return new

  def text(self) -> str:
    return self._tokenizer.decode(self._ids)


def sample(model, tokenizer: tokenizer_lib.TextTokenizer, prompt: str, sampling: Sampling,
           write: Callable[[str], None]) -> tuple[list[str], Timing]:
  """Samples sampling.num_samples continuations of `prompt` as one batch.

  With one sample its text is passed to `write` as it is decoded; with several, each is
  written whole, under a "--- sample i ---" line, once all are done.

  Returns:
    (the continuations, without the prompt and the final EOS; the timing).
  """
  ids = prompt_ids(tokenizer, prompt)
  batch = np.asarray([ids] * sampling.num_samples, np.int32)
  streams = [TextStream(tokenizer) for _ in range(sampling.num_samples)]
  done = np.zeros(sampling.num_samples, bool)
  new_tokens, first_token_s = 0, 0.0
  start = time.perf_counter()
  for tokens in decoding.stream(model, batch, sampling.max_new_tokens, sampling.temperature,
                                sampling.top_k, sampling.seed, sampling.top_p):
    if not new_tokens:
      first_token_s = time.perf_counter() - start
    new_tokens += int(np.sum(~done))
    for row in np.flatnonzero(~done):
      if tokens[row] == tokenizer.eos_id:
        done[row] = True
        continue
      text = streams[row].add(tokens[row])
      if sampling.num_samples == 1 and text:
        write(text)
    if done.all():
      break
  total_s = time.perf_counter() - start
  texts = [s.text() for s in streams]
  if sampling.num_samples == 1:
    write(streams[0].flush())
  else:
    for index, text in enumerate(texts):
      write(f"--- sample {index + 1} ---\n{prompt}{text}\n")
  return texts, Timing(len(ids), new_tokens, first_token_s,
                       new_tokens - sampling.num_samples, total_s - first_token_s)


def timing_line(timings: Sequence[Timing]) -> str:
  """One line: new tokens, time to the first token, tokens/s after it."""
  new = sum(t.new_tokens for t in timings)
  later = sum(t.rest_tokens for t in timings)
  rest_s = sum(t.rest_s for t in timings)
  first_s = sum(t.first_token_s for t in timings) / len(timings)
  rate = f"{later / rest_s:.1f} tokens/s after the first" if rest_s > 0 else "no later token"
  return (f"{new} new tokens for {len(timings)} prompt(s): first token after {first_s:.2f} s "
          f"on average (prefill, and compilation on first use), then {rate}")
