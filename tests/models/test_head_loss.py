"""The sliced head cross-entropy against the unfused one: values, hits and gradients."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from palimpsa_jax.data.mqar import IGNORE_INDEX
from palimpsa_jax.models import build_model, head_loss, language_model, model_config
from tests.ops.numerics import BFLOAT16_TOL, assert_close_to_reference

BATCH, LENGTH, DIM, VOCAB = 3, 12, 16, 40


def _unfused(h, table, targets):
  """Per-position nll and hit from the whole float32 logits (the tied head's custom VJP)."""
  logits = language_model.tied_head_logits(h, table)
  valid = targets != IGNORE_INDEX
  safe = jnp.where(valid, targets, 0)
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(log_probs, safe[..., None], axis=-1)[..., 0]
  return jnp.where(valid, nll, 0.0), valid & (jnp.argmax(logits, axis=-1) == targets)


def _inputs(dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  h = jax.random.normal(keys[0], (BATCH, LENGTH, DIM)).astype(dtype)
  table = (0.5 * jax.random.normal(keys[1], (VOCAB, DIM))).astype(dtype)
  targets = jax.random.randint(keys[2], (BATCH, LENGTH), 0, VOCAB)
  targets = jnp.where(jax.random.bernoulli(keys[3], 0.3, targets.shape), IGNORE_INDEX, targets)
  # A position whose target is its argmax, so the hits are not all False.
  logits = jnp.einsum("btd,vd->btv", h, table, preferred_element_type=jnp.float32)
  targets = targets.at[0, 0].set(jnp.argmax(logits[0, 0]))
  weights = jax.random.uniform(keys[3], (BATCH, LENGTH))
  return h, table, targets, weights


def _value_and_grads(loss_fn, h, table, targets, weights):
  """(nll, correct) and the gradients of sum(weights * nll) w.r.t. h and table."""
  def weighted(h, table):
    nll, correct = loss_fn(h, table, targets)
    return jnp.sum(weights * nll), (nll, correct)
  (_, out), grads = jax.jit(jax.value_and_grad(weighted, argnums=(0, 1), has_aux=True))(
      h, table)
  return out, grads


@pytest.mark.parametrize("slice_logits,slices", [(head_loss.SLICE_LOGITS, 1),
                                                  (BATCH * 2 * VOCAB, LENGTH // 2)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matches_the_unfused_loss(dtype, slice_logits, slices, monkeypatch):
  """One slice, and 6 slices of 2 positions a row (the budget forces them)."""
  monkeypatch.setattr(head_loss, "SLICE_LOGITS", slice_logits)
  assert head_loss.num_slices(BATCH, LENGTH, VOCAB) == slices
  inputs = _inputs(jnp.dtype(dtype))
  (nll, correct), grads = _value_and_grads(head_loss.head_cross_entropy, *inputs)
  (ref_nll, ref_correct), ref_grads = _value_and_grads(_unfused, *inputs)
  chex.assert_trees_all_equal(correct, ref_correct)
  assert bool(correct[0, 0]) and not bool(jnp.any(correct & (inputs[2] == IGNORE_INDEX)))
  assert float(jnp.max(jnp.abs(nll[inputs[2] == IGNORE_INDEX]))) == 0.0
  chex.assert_trees_all_equal_shapes_and_dtypes(grads, ref_grads)
  # float32 holds the project's 1e-5 for values and gradients alike: both forms
  # compute the same float32 logits; only the order of a few reductions differs.
  tol = 1e-5 if dtype == "float32" else BFLOAT16_TOL
  assert_close_to_reference({"nll": nll}, {"nll": ref_nll}, 1e-5)
  assert_close_to_reference({"dh": grads[0], "d_table": grads[1]},
                            {"dh": ref_grads[0], "d_table": ref_grads[1]}, tol)


def test_slices_divide_the_length_within_the_budget():
  assert head_loss.num_slices(128, 128, 8192) == 8  # MQAR's paper setting.
  assert head_loss.num_slices(2, 10, 3) == 1
  for batch, length, vocab in [(4, 4096, 32000), (3, 7, 1 << 24), (8, 96, 50277)]:
    count = head_loss.num_slices(batch, length, vocab)
    assert length % count == 0
    assert batch * (length // count) * vocab <= head_loss.SLICE_LOGITS or count == length


def test_bad_inputs_name_the_argument():
  h, table, targets, _ = _inputs(jnp.float32)
  with pytest.raises(ValueError, match="targets must be"):
    head_loss.head_cross_entropy(h, table, targets[:, 1:])
  with pytest.raises(ValueError, match="table must have h's dtype"):
    head_loss.head_cross_entropy(h, table.astype(jnp.bfloat16), targets)
  with pytest.raises(ValueError, match="h must be"):
    head_loss.head_cross_entropy(h[0], table, targets)


def test_model_token_losses_match_its_logits(monkeypatch):
  """bfloat16 compute (tests/training/test_steps.py checks float32 and the gradients)."""
  monkeypatch.setattr(head_loss, "SLICE_LOGITS", 2 * 4 * 512)  # 2 slices of 4 positions.
  config = model_config("palimpsa_d", "tiny", dtype="bfloat16", num_layers=1)
  lm = build_model(config, nnx.Rngs(0))
  assert head_loss.num_slices(2, 8, config.vocab_size) == 2
  tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, config.vocab_size)
  targets = jnp.roll(tokens, -1, axis=1).at[:, -1].set(IGNORE_INDEX)
  nll, correct = nnx.jit(lambda m: m.token_losses(tokens, targets))(lm)
  ref_nll, ref_correct = _unfused_from_logits(nnx.jit(lambda m: m(tokens))(lm), targets)
  chex.assert_trees_all_equal(correct, ref_correct)
  assert_close_to_reference({"nll": nll}, {"nll": ref_nll}, 1e-5)
  with pytest.raises(ValueError, match=r"targets must be \[B, T\]"):
    lm.token_losses(tokens, targets[:, :3])


def _unfused_from_logits(logits, targets):
  valid = targets != IGNORE_INDEX
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(log_probs, jnp.where(valid, targets, 0)[..., None], -1)[..., 0]
  return jnp.where(valid, nll, 0.0), valid & (jnp.argmax(logits, axis=-1) == targets)


def test_sliced_gradients_do_not_depend_on_the_slicing(monkeypatch):
  """float64 inputs: every slicing gives the same gradients to float64 rounding."""
  rng = np.random.default_rng(0)
  with jax.enable_x64(True):
    h = jnp.asarray(rng.normal(size=(2, 6, 4)))
    table = jnp.asarray(rng.normal(size=(5, 4)))
    targets = jnp.asarray(rng.integers(0, 5, size=(2, 6)))

    def total(h, table):
      return jnp.sum(head_loss.head_cross_entropy(h, table, targets)[0])

    def reference(h, table):
      logits = jnp.einsum("btd,vd->btv", h, table)
      log_probs = jax.nn.log_softmax(logits, axis=-1)
      return -jnp.sum(jnp.take_along_axis(log_probs, targets[..., None], -1))

    expected = jax.grad(reference, argnums=(0, 1))(h, table)
    for budget in (1 << 24, 2 * 3 * 5, 2 * 5):
      monkeypatch.setattr(head_loss, "SLICE_LOGITS", budget)
      grads = jax.grad(total, argnums=(0, 1))(h, table)
      chex.assert_trees_all_close(grads, expected, rtol=1e-12, atol=1e-12)
