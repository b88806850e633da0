"""Sampling with a fixed-shape cache under jit: all at once (`generate`) or streamed (`stream`).

Both run the model's recurrent decode path: a prefill of the prompt into the cache, then one
cached step per new token (O(1) state per token for the recurrent mixers, a KV cache for
attention). The same seed gives the same tokens on both.
"""

from collections.abc import Iterator
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from palimpsa_jax.models.language_model import LanguageModel


# Prompt tokens per prefill call of `stream`: bounds the prefill's logits and attention scores.
PREFILL_CHUNK = 512


def sample_token(logits: jax.Array, key: jax.Array, temperature: float,
                 top_k: int, top_p: float = 1.0) -> jax.Array:
  """logits [B, vocab] -> tokens [B] int32; temperature 0 is greedy.

  top_k > 0 keeps the k most likely tokens; top_p < 1 keeps the smallest set of
  most likely tokens whose probability reaches top_p (nucleus sampling).
  """
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / temperature
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1:
    ordered = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    cutoff = jnp.min(jnp.where(mass_before < top_p, ordered, jnp.inf), axis=-1,
                     keepdims=True)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature",
                              "top_k", "top_p"))
def _generate(graphdef, state, prompt_tokens, key, max_new_tokens,
              temperature, top_k, top_p):
  model = nnx.merge(graphdef, state)
  batch, prompt_length = prompt_tokens.shape
  cache = model.init_cache(batch, prompt_length + max_new_tokens)
  logits, cache = model.prefill(prompt_tokens, cache)
  keys = jax.random.split(key, max_new_tokens)
  first = sample_token(logits[:, -1], keys[0], temperature, top_k, top_p)

  def body(carry, step_key):
    token, cache = carry
    logits, cache = model.step(token[:, None], cache)
    next_token = sample_token(logits[:, 0], step_key, temperature, top_k,
                              top_p)
    return (next_token, cache), next_token

  _, rest = jax.lax.scan(body, (first, cache), keys[1:])
  return jnp.concatenate([first[:, None], rest.T], axis=1)


def _check_arguments(model: LanguageModel, prompt_tokens: jax.Array,
                     max_new_tokens: int, temperature: float, top_k: int,
                     top_p: float) -> None:
  if prompt_tokens.ndim != 2 or prompt_tokens.shape[1] < 1:
    raise ValueError(
        f"prompt_tokens must be [B, T] with T >= 1, got {prompt_tokens.shape}")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if not 0 <= top_k <= model.vocab_size:
    raise ValueError(
        f"top_k must be in [0, {model.vocab_size}], got {top_k}")
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def generate(model: LanguageModel, prompt_tokens: jax.Array,
             max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             seed: int = 0, top_p: float = 1.0) -> jax.Array:
  """Samples max_new_tokens after prompt_tokens [B, T]; returns [B, new] int32.

  Prefills the prompt, then one cached step per token inside a jitted
  lax.scan; the same seed gives the same tokens. temperature 0 is greedy;
  top_k 0 and top_p 1 sample from the full vocabulary.
  """
  _check_arguments(model, prompt_tokens, max_new_tokens, temperature, top_k,
                   top_p)
  graphdef, state = nnx.split(model)
  return _generate(graphdef, state, prompt_tokens.astype(jnp.int32),
                   jax.random.key(seed), max_new_tokens, float(temperature),
                   int(top_k), float(top_p))


@functools.partial(jax.jit, static_argnames=("graphdef",),
                   donate_argnames=("cache",))
def _prefill(graphdef, state, tokens, cache):
  logits, cache = nnx.merge(graphdef, state).prefill(tokens, cache)
  return logits[:, -1], cache


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "top_k",
                                             "top_p"),
                   donate_argnames=("cache",))
def _sample_and_step(graphdef, state, logits, cache, key, temperature, top_k,
                     top_p):
  token = sample_token(logits, key, temperature, top_k, top_p)
  logits, cache = nnx.merge(graphdef, state).step(token[:, None], cache)
  return token, logits[:, 0], cache


def stream(model: LanguageModel, prompt_tokens: jax.Array, max_new_tokens: int,
           temperature: float = 1.0, top_k: int = 0, seed: int = 0,
           top_p: float = 1.0,
           prefill_chunk: int = PREFILL_CHUNK) -> Iterator[np.ndarray]:
  """Yields the new tokens of prompt_tokens [B, T] one step at a time, each [B] int32.

  The same tokens as `generate` with the same arguments, produced by jitted
  calls from Python so that a caller can print (or stop) as they come: the
  prompt is prefilled `prefill_chunk` tokens per call, then each step samples
  a token and advances the cache by it. Stopping the iteration early is fine.
  One compilation per prompt-chunk shape and per cache shape.
  """
  _check_arguments(model, prompt_tokens, max_new_tokens, temperature, top_k,
                   top_p)
  if prefill_chunk < 1:
    raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
  graphdef, state = nnx.split(model)
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  batch, prompt_length = prompt_tokens.shape
  cache = model.init_cache(batch, prompt_length + max_new_tokens)
  for start in range(0, prompt_length, prefill_chunk):
    logits, cache = _prefill(graphdef, state,
                             prompt_tokens[:, start:start + prefill_chunk],
                             cache)
  keys = jax.random.split(jax.random.key(seed), max_new_tokens)
  for step_key in keys:
    token, logits, cache = _sample_and_step(
        graphdef, state, logits, cache, step_key, float(temperature),
        int(top_k), float(top_p))
    yield np.asarray(token)
