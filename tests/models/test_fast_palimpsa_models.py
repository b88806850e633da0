"""precision="rank1" (Fast Palimpsa) in the models: decoding == forward, configs, errors."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from palimpsa_jax.layers import PalimpsaD
from palimpsa_jax.models import build_model, generate, model_config
from tests.ops.numerics import assert_close_to_reference, rel_error

BATCH, LENGTH, PREFIX = 2, 11, 5
REPO = pathlib.Path(__file__).resolve().parents[2]


def _tiny(model, precision):
  # The beta up-projection's bias makes beta vary over V from the first step, where the
  # rank-1 form is not exact (without it, beta starts nearly constant over V).
  config = model_config(model, "tiny", dtype="float32", chunk_size=4, num_layers=1,
                        precision=precision, beta_bias=True)
  return config, build_model(config, nnx.Rngs(0))


@pytest.mark.parametrize("model", ["palimpsa_d", "meta_mamba2"])
def test_prefill_then_steps_equal_the_forward(model):
  """A prefix that ends inside a chunk, then one token at a time: the logits of the chunked
  forward, which differ from the exact model's."""
  config, lm = _tiny(model, "rank1")
  tokens = jax.random.randint(jax.random.key(1), (BATCH, LENGTH), 0, config.vocab_size)
  logits = nnx.jit(lambda m, t: m(t))(lm, tokens)
  out, cache = nnx.jit(lambda m, t, c: m.prefill(t, c))(lm, tokens[:, :PREFIX],
                                                        lm.init_cache(BATCH, LENGTH))
  outputs = [out]
  step = nnx.jit(lambda m, t, c: m.step(t, c))
  for t in range(PREFIX, LENGTH):
    out, cache = step(lm, tokens[:, t:t + 1], cache)
    outputs.append(out)
  assert_close_to_reference(jnp.concatenate(outputs, axis=1), logits, 1e-4)
  _, exact = _tiny(model, "exact")  # the same weights (same seed), the exact op
  assert rel_error(nnx.jit(lambda m, t: m(t))(exact, tokens), logits) > 1e-6
  assert generate(lm, tokens[:, :3], 4).shape == (BATCH, 4)


def test_bad_precision_names_the_field():
  with pytest.raises(ValueError, match="precision must be one of"):
    PalimpsaD(16, num_heads=2, head_k_dim=8, head_v_dim=8, beta_rank=2, rngs=nnx.Rngs(0),
              precision="rank2")
  config = model_config("gated_deltanet", "tiny", precision="rank1")
  with pytest.raises(ValueError, match="precision='rank1' needs a Palimpsa mixer"):
    build_model(config, nnx.Rngs(0))


def _config_module(name):
  spec = importlib.util.spec_from_file_location(name, REPO / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_configs_take_the_precision():
  mqar = _config_module("mqar").get_config("precision=rank1,chunk_size=16")
  assert (mqar.model.precision, mqar.model.chunk_size) == ("rank1", 16)
  assert _config_module("mqar").get_config().model.precision == "exact"
  lm = _config_module("lm").get_config("size=tiny,precision=rank1")
  assert lm.model.precision == "rank1"
