"""Language model: shapes per model, decoding == forward, gradients, generation."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from palimpsa_jax.layers import Attention
from palimpsa_jax.models import activation_memory, build_model, generate, model_config
from palimpsa_jax.models.config import MODELS
from palimpsa_jax.models.language_model import LanguageModel
from tests.ops.numerics import assert_close_to_reference

BATCH, LENGTH, PREFIX = 2, 10, 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", MODELS)
def test_forward_shapes_and_dtypes(model, dtype):
  config = model_config(model, "tiny", dtype=dtype)
  lm = nnx.eval_shape(lambda: build_model(config, nnx.Rngs(0)))
  tokens = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32)
  logits, diagnostics = nnx.eval_shape(
      lambda m, t: m(t, segment_ids=t, return_diagnostics=True), lm, tokens)
  chex.assert_shape(logits, (BATCH, LENGTH, config.vocab_size))
  chex.assert_type(logits, jnp.float32)
  assert len(diagnostics) == config.num_layers
  block = lm.blocks[0]
  hidden = jax.ShapeDtypeStruct((BATCH, LENGTH, config.d_model), jnp.float32)
  out = nnx.eval_shape(lambda m, h: m.mixer(m.mixer_norm(h)), block, hidden)
  chex.assert_type(out, jnp.dtype(dtype))
  chex.assert_type(jax.tree.leaves(nnx.state(lm, nnx.Param)), jnp.float32)
  cache = nnx.eval_shape(lambda m: m.init_cache(BATCH, LENGTH), lm)
  _, new_cache = nnx.eval_shape(
      lambda m, t, c: m.step(t, c), lm,
      jax.ShapeDtypeStruct((BATCH, 1), jnp.int32), cache)
  chex.assert_trees_all_equal_shapes_and_dtypes(new_cache, cache)


def test_mamba_blocks_have_no_mlp_and_remat_keeps_the_gradients():
  config = model_config("mamba2", "tiny", dtype="float32", num_layers=1)
  lm = build_model(config, nnx.Rngs(0))
  assert lm.blocks[0].mlp is None
  tokens = jax.random.randint(jax.random.key(1), (BATCH, LENGTH), 0, config.vocab_size)
  grad = nnx.jit(lambda m, t: nnx.grad(lambda m: jnp.mean(jax.nn.log_softmax(m(t))[..., 0]))(m))
  plain = nnx.to_pure_dict(grad(lm, tokens))
  lm.remat = True
  rematerialised = nnx.to_pure_dict(grad(lm, tokens))
  chex.assert_trees_all_close(rematerialised, plain, rtol=1e-5, atol=1e-8)
  assert np.any(plain["blocks"][0]["mixer"]["in_proj"]["kernel"] != 0)


def test_residual_stream_in_the_compute_dtype():
  """residual_in_fp32=False keeps the residual stream in bfloat16: each block keeps its input
  at half the bytes, and the step's loss and gradients stay close to the float32 stream's."""
  configs = {flag: model_config("palimpsa_d", "tiny", dtype="bfloat16", chunk_size=4,
                                residual_in_fp32=flag) for flag in (True, False)}
  kept = {flag: activation_memory.kept_bytes(activation_memory.gpu_program(c), 2, 64)
          for flag, c in configs.items()}
  d_model = configs[True].d_model
  assert kept[True]["per_token"] - kept[False]["per_token"] == 2 * d_model
  tokens = jax.random.randint(jax.random.key(1), (BATCH, LENGTH), 0, configs[True].vocab_size)
  loss = lambda m: jnp.mean(jax.nn.log_softmax(m(tokens))[..., 0])
  results = {flag: nnx.jit(nnx.value_and_grad(loss))(build_model(c, nnx.Rngs(0)))
             for flag, c in configs.items()}
  (value32, grads32), (value16, grads16) = results[True], results[False]
  chex.assert_trees_all_close(value16, value32, rtol=2e-2)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads16))


@pytest.fixture(scope="module")
def palimpsa_lm():
  config = model_config("palimpsa_d", "tiny", dtype="float32", chunk_size=4)
  lm = build_model(config, nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (BATCH, LENGTH), 0,
                              config.vocab_size)
  return lm, tokens


def test_prefill_then_steps_equal_forward(palimpsa_lm):
  lm, tokens = palimpsa_lm
  logits = nnx.jit(lambda m, t: m(t))(lm, tokens)
  cache = lm.init_cache(BATCH, LENGTH)
  out, cache = nnx.jit(lambda m, t, c: m.prefill(t, c))(
      lm, tokens[:, :PREFIX], cache)
  outputs = [out]
  step = nnx.jit(lambda m, t, c: m.step(t, c))
  for t in range(PREFIX, LENGTH):
    out, cache = step(lm, tokens[:, t:t + 1], cache)
    outputs.append(out)
  assert_close_to_reference(jnp.concatenate(outputs, axis=1), logits, 1e-4)


def test_gradients_finite(palimpsa_lm):
  lm, tokens = palimpsa_lm
  grads = nnx.jit(lambda m, t: nnx.grad(
      lambda m: jnp.mean(jax.nn.log_softmax(m(t))[..., 0]))(m))(lm, tokens)
  chex.assert_tree_all_finite(
      {"/".join(map(str, path)): g[...] for path, g in nnx.to_flat_state(grads)})
  assert np.any(grads["embed"][...] != 0)


def test_generate_is_deterministic_per_seed(palimpsa_lm):
  lm, tokens = palimpsa_lm
  prompt = tokens[:, :PREFIX]
  first = generate(lm, prompt, 6, temperature=1.0, top_k=50, seed=3)
  again = generate(lm, prompt, 6, temperature=1.0, top_k=50, seed=3)
  other = generate(lm, prompt, 6, temperature=1.0, top_k=50, seed=4)
  chex.assert_shape(first, (BATCH, 6))
  chex.assert_type(first, jnp.int32)
  chex.assert_trees_all_equal(first, again)
  assert not np.array_equal(first, other)
  assert np.all((first >= 0) & (first < lm.vocab_size))


def test_generation_traces_the_decode_step_once(palimpsa_lm, monkeypatch):
  """New prompts and seeds of one shape reuse the compiled generation, so the cached decode
  step is traced once; a sampling setting that changes per call (a static Python float)
  retraces it, which the guard turns into a failure."""
  lm, tokens = palimpsa_lm
  chex.clear_trace_counter()
  monkeypatch.setattr(LanguageModel, "step", chex.assert_max_traces(LanguageModel.step, n=1))
  for seed in range(3):
    new = generate(lm, tokens[:, seed:seed + PREFIX], 3, temperature=0.9, top_k=5, seed=seed)
  chex.assert_shape(new, (BATCH, 3))
  with pytest.raises(AssertionError, match="traced > 1 times"):
    generate(lm, tokens[:, :PREFIX], 3, temperature=0.8, top_k=5)


def test_bad_inputs_raise(palimpsa_lm):
  lm, tokens = palimpsa_lm
  with pytest.raises(ValueError, match=r"tokens must be \[B, T\] integers"):
    lm(tokens.astype(jnp.float32))
  with pytest.raises(ValueError, match="segment_ids must be"):
    lm(tokens, segment_ids=tokens[:, :3])
  with pytest.raises(ValueError, match="max_new_tokens"):
    generate(lm, tokens, 0)
  with pytest.raises(ValueError, match=r"tokens must be \[B, 1\]"):
    lm.step(tokens, lm.init_cache(BATCH, LENGTH))


def test_kv_cache_overflow_raises():
  config = model_config("transformer", "tiny", dtype="float32")
  lm = nnx.eval_shape(lambda: build_model(config, nnx.Rngs(0)))
  cache = nnx.eval_shape(lambda m: m.init_cache(BATCH, 4), lm)
  with pytest.raises(ValueError, match="5 positions, more than the KV cache's 4"):
    nnx.eval_shape(lambda m, t, c: m.prefill(t, c), lm,
                   jax.ShapeDtypeStruct((BATCH, 5), jnp.int32), cache)
  x = jnp.zeros((BATCH, 3, config.d_model))
  attention = Attention(config.d_model, num_heads=2, head_dim=4, rngs=nnx.Rngs(0))
  cache = attention.init_cache(BATCH, 4)
  _, cache = attention.prefill(x, cache)
  _, cache = attention.step(x[:, :1], cache)
  with pytest.raises(ValueError, match="holds 4 of 4 positions"):
    attention.step(x[:, :1], cache)
