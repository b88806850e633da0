"""Which Pallas kernels a block's gradient runs under each remat policy (traced, not run)."""

import collections

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from palimpsa_jax import models
from palimpsa_jax.models.language_model import REMAT_SAVES, Block
from pallas_kernels.palimpsa_gpu import config as gpu_config
from pallas_kernels.palimpsa_gpu import op as gpu_op

# The compute capability the kernels are chosen for: the Triton kernels (pallas_call) off
# Hopper, the Mosaic GPU ones (plgpu.kernel: mpmd_map inside a custom_vmap_call) on it.
CAPABILITIES = {"triton": (8, 0), "mosaic": (9, 0)}


def _kernel_calls(jaxpr, counts):
  """counts[kernel name] += 1 for every Pallas kernel (pallas_call, mpmd_map) in jaxpr and
  the jaxprs inside it."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("pallas_call", "mpmd_map"):
      counts[eqn.params["name"].removesuffix("_mosaic")] += 1
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", param)
      if isinstance(inner, jax.extend.core.Jaxpr):
        _kernel_calls(inner, counts)
  return counts


def _gradient_kernels(monkeypatch, saves, kernels="triton"):
  # The GPU kernels' platform check guards compiled runs; this only traces.
  monkeypatch.setattr(gpu_op, "_check_nvidia_gpu", lambda: None)
  monkeypatch.setattr(gpu_config, "compute_capability", lambda: CAPABILITIES[kernels])
  config = models.model_config("palimpsa_d", "tiny", implementation="pallas_gpu",
                               chunk_size=16)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Block(config, nnx.Rngs(0))))

  def loss(params, h):
    return jnp.sum(nnx.merge(graphdef, params)(h, None, False)[0].astype(jnp.float32))

  if saves is not None:
    loss = jax.checkpoint(loss, policy=REMAT_SAVES[saves])
  h = jax.ShapeDtypeStruct((2, 64, config.d_model), jnp.float32)
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=1))(params, h)
  return dict(_kernel_calls(jaxpr.jaxpr, collections.Counter()))


# The boundary kernel runs twice in every case: the backward recomputes the chunk-start
# states instead of keeping them.
ONCE = {"palimpsa_boundary": 2, "palimpsa_walk_forward": 1, "palimpsa_walk_backward": 1,
        "palimpsa_adjoint_carries": 1}


@pytest.mark.parametrize("kernels", sorted(CAPABILITIES))
@pytest.mark.parametrize("saves", [None, "matmuls_readouts_and_states"])
def test_no_forward_kernel_runs_twice(monkeypatch, saves, kernels):
  assert _gradient_kernels(monkeypatch, saves, kernels) == ONCE


def test_remat_keeping_only_matmuls_reruns_the_forward_walk(monkeypatch):
  counts = _gradient_kernels(monkeypatch, "matmuls")
  assert counts["palimpsa_walk_forward"] == 2
