"""head_cross_entropy(implementation="pallas_gpu") against the unfused loss: interpreted on
CPU, compiled on a GPU (-m gpu)."""

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from palimpsa_jax.data.mqar import IGNORE_INDEX
from palimpsa_jax.models import build_model, head_loss, model_config
from tests.models.test_head_loss import _unfused, _value_and_grads
from tests.ops.numerics import BFLOAT16_TOL, assert_close_to_reference

# Rows, vocabulary and width that need padding (36 of 64 rows, 300 of 384 columns over
# three tiles, 24 of 32 features).
BATCH, LENGTH, DIM, VOCAB = 3, 12, 24, 300
TIED_A, TIED_B = 10, 150  # Two equal rows of the table in different tiles.


def _inputs(dtype):
  keys = jax.random.split(jax.random.key(0), 4)
  h = jax.random.normal(keys[0], (BATCH, LENGTH, DIM))
  table = 0.5 * jax.random.normal(keys[1], (VOCAB, DIM))
  # Position (0, 0)'s two largest logits tie, in different tiles: the first one is the hit.
  top = 4.0 * h[0, 0] / jnp.linalg.norm(h[0, 0])
  table = table.at[TIED_A].set(top).at[TIED_B].set(top)
  targets = jax.random.randint(keys[2], (BATCH, LENGTH), 0, VOCAB)
  targets = jnp.where(jax.random.bernoulli(keys[3], 0.3, targets.shape), IGNORE_INDEX, targets)
  targets = targets.at[0, 0].set(TIED_A).at[0, 1].set(IGNORE_INDEX)
  weights = jax.random.uniform(keys[3], (BATCH, LENGTH))
  return h.astype(dtype), table.astype(dtype), targets, weights


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_matches_the_unfused_loss(dtype, interpret):
  inputs = _inputs(jnp.dtype(dtype))
  pallas = lambda h, table, targets: head_loss.head_cross_entropy(
      h, table, targets, implementation="pallas_gpu", interpret=interpret)
  # The reference's products in float32 (the GPU's default would be TF32 on both sides).
  with jax.default_matmul_precision("highest" if interpret else "default"):
    (nll, correct), grads = _value_and_grads(pallas, *inputs)
    (ref_nll, ref_correct), ref_grads = _value_and_grads(_unfused, *inputs)
  chex.assert_trees_all_equal(correct, ref_correct)
  assert bool(correct[0, 0])
  assert float(jnp.max(jnp.abs(nll[inputs[2] == IGNORE_INDEX]))) == 0.0
  chex.assert_trees_all_equal_shapes_and_dtypes(grads, ref_grads)
  tol = 1e-5 if dtype == "float32" and interpret else BFLOAT16_TOL
  assert_close_to_reference({"nll": nll}, {"nll": ref_nll}, tol)
  assert_close_to_reference({"dh": grads[0], "d_table": grads[1]},
                            {"dh": ref_grads[0], "d_table": ref_grads[1]}, tol)


def test_pallas_refuses_wide_heads_and_unknown_implementations():
  h, table, targets, _ = _inputs(jnp.float32)
  wide = jnp.zeros((2, 4, 300)), jnp.zeros((VOCAB, 300)), targets[:2, :4]
  with pytest.raises(ValueError, match="d up to 256"):
    head_loss.head_cross_entropy(*wide, implementation="pallas_gpu", interpret=True)
  with pytest.raises(ValueError, match="implementation must be"):
    head_loss.head_cross_entropy(h, table, targets, implementation="cuda")


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu)])
def test_model_config_head_loss_selects_the_kernels(interpret, monkeypatch):
  """config.head_loss="pallas_gpu" gives the model's token losses of "xla" (MQAR's d of 128)."""
  calls = []
  original = head_loss.head_cross_entropy

  def recording(h, table, targets, *, implementation):
    calls.append(implementation)
    return original(h, table, targets, implementation=implementation,
                    interpret=interpret and implementation == "pallas_gpu")

  monkeypatch.setattr(head_loss, "head_cross_entropy", recording)
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 512)
  targets = jnp.roll(tokens, -1, axis=1).at[:, -1].set(IGNORE_INDEX)
  results = {}
  for implementation in head_loss.IMPLEMENTATIONS:
    config = model_config("palimpsa_d", "tiny", dtype="float32", num_layers=1,
                          head_loss=implementation)
    lm = build_model(config, nnx.Rngs(0))
    with jax.default_matmul_precision("highest"):
      results[implementation] = nnx.jit(lambda m: m.token_losses(tokens, targets))(lm)
  assert calls == list(head_loss.IMPLEMENTATIONS)
  chex.assert_trees_all_equal(results["pallas_gpu"][1], results["xla"][1])
  assert_close_to_reference({"nll": results["pallas_gpu"][0]}, {"nll": results["xla"][0]},
                            1e-5 if interpret else BFLOAT16_TOL)


def test_model_refuses_an_unknown_head_loss():
  config = model_config("palimpsa_d", "tiny", head_loss="cuda")
  with pytest.raises(ValueError, match="config.head_loss must be one of"):
    build_model(config, nnx.Rngs(0))
