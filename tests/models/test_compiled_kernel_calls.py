"""The compiled step launches each Pallas kernel as often as the traced program asks.

XLA's GPU compiler (jaxlib 0.11.2) may copy a kernel call while rewriting it to write
into a scan's stacked buffer in place (layers/readout.py): these tests count the kernel
custom calls before and after compilation.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
# jax.ad_checkpoint.print_saved_residuals' engine (benchmarks/step/activation_bytes.py says why).
from jax._src.ad_checkpoint import saved_residuals

from palimpsa_jax.layers.readout import READOUT, named_readout
from palimpsa_jax.models import build_model, model_config

# Pallas' custom-call targets: Mosaic GPU and Triton.
_KERNEL = r"(mosaic_gpu\w*|__gpu\$xla\.gpu\.triton)"


def test_named_readout_is_the_identity_and_keeps_its_name():
  x = jax.random.normal(jax.random.key(0), (2, 3, 4))
  assert jnp.array_equal(named_readout(x), x)
  value, grad = jax.value_and_grad(lambda x: jnp.sum(named_readout(x) * x))(x)
  assert jnp.allclose(grad, 2 * x) and jnp.allclose(value, jnp.sum(x * x))
  saves_readout = jax.checkpoint_policies.save_only_these_names(READOUT)
  saved = saved_residuals(
      jax.checkpoint(lambda x: jnp.sum(jnp.sin(named_readout(jnp.cos(x)))),
                     policy=saves_readout), x)
  assert any(READOUT in source for _, source in saved), saved


@pytest.mark.gpu
@pytest.mark.parametrize("remat", [False, True])
def test_scanned_gradient_compiles_each_kernel_call_once(remat):
  config = model_config("palimpsa_d", "tiny", dtype="bfloat16", num_layers=3,
                        implementation="pallas_gpu")
  config.scan_layers = True
  config.remat = remat
  config.remat_saves = "matmuls_readouts_and_states"
  graphdef, params = nnx.split(build_model(config, nnx.Rngs(0)))
  tokens = jnp.zeros((2, 256), jnp.int32)

  def loss(params):
    logits = nnx.merge(graphdef, params)(tokens)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 1])

  lowered = jax.jit(jax.grad(loss)).lower(params)
  traced = len(re.findall(r"stablehlo\.custom_call @" + _KERNEL, lowered.as_text()))
  compiled = lowered.compile().as_text()
  assert traced == 5  # boundary twice (forward, backward), the walks, the carries
  assert len(re.findall(r'custom_call_target="' + _KERNEL + '"', compiled)) == traced
