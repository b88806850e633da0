"""LanguageModel.token_losses: the token_loss op on the model's final hidden states equals the
loss of the model's own logits (tests/ops/test_token_loss.py checks the op itself)."""

import chex
from flax import nnx
import jax
import jax.numpy as jnp
import pytest

from palimpsa_jax.models import build_model, model_config
from palimpsa_jax.ops.token_loss import logits_token_loss, sliced
from tests.ops.numerics import FLOAT32_TOL, assert_close_to_reference


def test_model_token_losses_match_its_logits(monkeypatch):
  """bfloat16 compute, 2 slices of 4 positions, a mask (tests/training/test_steps.py checks
  float32 and the gradients)."""
  monkeypatch.setattr(sliced, "SLICE_LOGITS", 2 * 4 * 512)
  config = model_config("palimpsa_d", "tiny", dtype="bfloat16", num_layers=1)
  lm = build_model(config, nnx.Rngs(0))
  assert sliced.num_slices(2, 8, config.vocab_size) == 2
  tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, config.vocab_size)
  targets = jnp.roll(tokens, -1, axis=1)
  mask = jnp.ones(targets.shape, bool).at[:, -1].set(False)
  loss = nnx.jit(lambda m: m.token_losses(tokens, targets, mask))(lm)
  ref = logits_token_loss(nnx.jit(lambda m: m(tokens))(lm), targets, mask)
  chex.assert_trees_all_equal(loss.correct, ref.correct)
  chex.assert_trees_all_equal(loss.weights, ref.weights)
  assert float(loss.weights.sum()) == 14
  assert_close_to_reference({"nll": loss.nll, "lse": loss.lse},
                            {"nll": ref.nll, "lse": ref.lse}, FLOAT32_TOL)
  with pytest.raises(ValueError, match=r"targets must be \[B, T\]"):
    lm.token_losses(tokens, targets[:, :3])
