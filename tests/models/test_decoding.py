"""Streamed decoding (models.decoding.stream) and nucleus sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from palimpsa_jax.models import build_model, decoding, generate, model_config

BATCH, PROMPT, NEW = 2, 7, 5


@pytest.mark.parametrize("model", ["palimpsa_d", "transformer"])
def test_stream_gives_generates_tokens_with_a_chunked_prefill(model):
  config = model_config(model, "tiny", dtype="float32", num_layers=1)
  lm = build_model(config, nnx.Rngs(0))
  prompt = jax.random.randint(jax.random.key(1), (BATCH, PROMPT), 0, config.vocab_size)
  expected = generate(lm, prompt, NEW, temperature=1.0, top_k=20, seed=3, top_p=0.9)
  streamed = list(decoding.stream(lm, prompt, NEW, temperature=1.0, top_k=20, seed=3,
                                  top_p=0.9, prefill_chunk=4))
  assert len(streamed) == NEW and streamed[0].shape == (BATCH,)
  np.testing.assert_array_equal(np.stack(streamed, axis=1), expected)


def test_top_p_keeps_the_smallest_set_reaching_p():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
  keys = jax.random.split(jax.random.key(0), 400)
  draw = jax.vmap(lambda k, p: decoding.sample_token(logits, k, 1.0, 0, p), in_axes=(0, None))
  assert set(np.asarray(draw(keys, 0.5)).ravel()) == {0}
  assert set(np.asarray(draw(keys, 0.7)).ravel()) == {0, 1}
  assert set(np.asarray(draw(keys, 0.81)).ravel()) == {0, 1, 2}
  assert set(np.asarray(draw(keys, 1.0)).ravel()) == {0, 1, 2, 3}


def test_stream_bad_arguments_raise():
  lm = build_model(model_config("palimpsa_d", "tiny", num_layers=1), nnx.Rngs(0))
  prompt = jnp.zeros((1, 3), jnp.int32)
  for kwargs, match in (({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                        ({"prefill_chunk": 0}, "prefill_chunk"),
                        ({"temperature": -1.0}, "temperature")):
    with pytest.raises(ValueError, match=match):
      next(decoding.stream(lm, prompt, 2, **kwargs))
