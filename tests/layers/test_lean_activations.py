"""The layers' lean backward (recompute instead of keep) against their plain formulas.

The layers wrap their elementwise parts in jax.checkpoint so the backward keeps fewer and
smaller arrays. "Plain" below is the same code with every such checkpoint removed, i.e.
what autodiff of the formula computes: values and gradients must agree to float32
rounding (float32), or to the rounding of the compute dtype (bfloat16).
"""

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from palimpsa_jax.layers import norms
from palimpsa_jax.models import model_config
from palimpsa_jax.models.language_model import Block

# Every lean piece is covered: Palimpsa-D (both precisions) and MetaMamba2 their own, Gated
# DeltaNet the q, k, v front and the norm-and-projection that MesaNet shares; bfloat16 runs
# the two metaplastic mixers.
CASES = [(model, precision, "float32") for model, precision in (
    ("palimpsa_d", "exact"), ("palimpsa_d", "rank1"), ("meta_mamba2", "exact"),
    ("gated_deltanet", "exact"))] + [("palimpsa_d", "exact", "bfloat16"),
                                     ("meta_mamba2", "exact", "bfloat16")]
# float32: rounding of reordered float32 sums; bfloat16: one bfloat16 step (2^-8) of the
# compute dtype, relative to each array's largest entry.
TOLERANCES = {"float32": 1e-5, "bfloat16": 1e-2}


def _plain(monkeypatch):
  """Removes every checkpoint of the layers: autodiff of the plain formulas."""
  monkeypatch.setattr(jax, "checkpoint", lambda fn, **kwargs: fn)
  monkeypatch.setattr(norms, "_l2_normalize", norms._l2_normalize.__wrapped__)
  monkeypatch.setattr(norms, "_rms_norm", norms._rms_norm.__wrapped__)


def _value_and_grads(block, h, w):
  def loss(block, h):
    out, _ = block(h, None, False)
    return jnp.sum(out.astype(jnp.float32) * w)

  return nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))(block, h)


def _assert_close(lean, plain, tol):
  for a, b in zip(jax.tree.leaves(lean), jax.tree.leaves(plain)):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    chex.assert_trees_all_close(a, b, rtol=0.0, atol=tol * (float(jnp.max(jnp.abs(b))) + 1e-30))


@pytest.mark.parametrize("model,precision,dtype", CASES)
def test_block_values_and_grads_equal_the_plain_formulas(monkeypatch, model, precision, dtype):
  config = model_config(model, "tiny", dtype=dtype, chunk_size=4, precision=precision)
  block = Block(config, nnx.Rngs(0))
  h = jax.random.normal(jax.random.key(1), (2, 12, config.d_model))
  w = jax.random.normal(jax.random.key(2), h.shape)
  lean = _value_and_grads(block, h, w)
  with monkeypatch.context() as patch:
    _plain(patch)
    plain = _value_and_grads(block, h, w)
  _assert_close(lean, plain, TOLERANCES[dtype])

