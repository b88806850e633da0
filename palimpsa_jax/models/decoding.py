"""Sampling with a fixed-shape cache under jit."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from palimpsa_jax.models.language_model import LanguageModel


def sample_token(logits: jax.Array, key: jax.Array, temperature: float,
                 top_k: int) -> jax.Array:
  """logits [B, vocab] -> tokens [B] int32; temperature 0 is greedy."""
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / temperature
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature",
                              "top_k"))
def _generate(graphdef, state, prompt_tokens, key, max_new_tokens,
              temperature, top_k):
  model = nnx.merge(graphdef, state)
  batch, prompt_length = prompt_tokens.shape
  cache = model.init_cache(batch, prompt_length + max_new_tokens)
  logits, cache = model.prefill(prompt_tokens, cache)
  keys = jax.random.split(key, max_new_tokens)
  first = sample_token(logits[:, -1], keys[0], temperature, top_k)

  def body(carry, step_key):
    token, cache = carry
    logits, cache = model.step(token[:, None], cache)
    next_token = sample_token(logits[:, 0], step_key, temperature, top_k)
    return (next_token, cache), next_token

  _, rest = jax.lax.scan(body, (first, cache), keys[1:])
  return jnp.concatenate([first[:, None], rest.T], axis=1)


def generate(model: LanguageModel, prompt_tokens: jax.Array,
             max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             seed: int = 0) -> jax.Array:
  """Samples max_new_tokens after prompt_tokens [B, T]; returns [B, new] int32.

  Prefills the prompt, then one cached step per token inside a jitted
  lax.scan; the same seed gives the same tokens. temperature 0 is greedy;
  top_k 0 samples from the full vocabulary.
  """
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
  graphdef, state = nnx.split(model)
  return _generate(graphdef, state, prompt_tokens.astype(jnp.int32),
                   jax.random.key(seed), max_new_tokens, float(temperature),
                   int(top_k))
