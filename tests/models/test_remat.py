"""config.remat recomputes each block in the backward pass except the recurrence op's readout.

The compiled GPU kernels are traced (not run) on the CPU as for a Hopper GPU: the gradient's
jaxpr then names each Mosaic kernel call, so it shows which of them run again in the backward.
"""

import collections

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.extend import core as jax_core

from palimpsa_jax.models import build_model, model_config
from palimpsa_jax.models import language_model
from palimpsa_jax.ops import kernel_sharding
from pallas_kernels.palimpsa_gpu import config as gpu_config
from pallas_kernels.palimpsa_gpu import op as gpu_op

WALK = "palimpsa_walk_forward_mosaic"
BOUNDARY = "palimpsa_boundary_mosaic"


@pytest.fixture(name="as_on_hopper")
def fixture_as_on_hopper(monkeypatch):
  monkeypatch.setattr(gpu_config, "compute_capability", lambda: (9, 0))
  monkeypatch.setattr(gpu_op, "_check_nvidia_gpu", lambda: None)


def kernel_calls(jaxpr: jax_core.Jaxpr, counts=None) -> collections.Counter:
  """How many calls of each named kernel `jaxpr` holds, inner jaxprs included."""
  counts = collections.Counter() if counts is None else counts
  for eqn in jaxpr.eqns:
    if isinstance(eqn.params.get("name"), str):
      counts[eqn.params["name"]] += 1
    for param in eqn.params.values():
      for inner in param if isinstance(param, (list, tuple)) else [param]:
        if isinstance(inner, jax_core.ClosedJaxpr):
          inner = inner.jaxpr
        if isinstance(inner, jax_core.Jaxpr):
          kernel_calls(inner, counts)
  return counts


def gradient_kernel_calls(scan_layers: bool, sharded: bool) -> tuple[int, int]:
  """(forward walks, boundary-state kernels) in a tiny Palimpsa-D's loss gradient with
  remat, on the GPU kernels."""
  config = model_config("palimpsa_d", "tiny", implementation="pallas_gpu", remat=True,
                        scan_layers=scan_layers, chunk_size=16)
  graphdef, params = nnx.split(build_model(config, nnx.Rngs(0)))
  tokens = jnp.zeros((2, 64), jnp.int32)
  grad = jax.grad(lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens)))
  if sharded:
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,))
    with kernel_sharding.kernel_sharding(mesh, batch_axes=("data",), head_axes=()):
      counts = kernel_calls(jax.make_jaxpr(grad)(params).jaxpr)
  else:
    counts = kernel_calls(jax.make_jaxpr(grad)(params).jaxpr)
  return counts[WALK], counts[BOUNDARY]


@pytest.mark.parametrize("scan_layers, sharded", [(False, False), (True, False), (False, True)])
def test_remat_runs_the_forward_walk_once(as_on_hopper, monkeypatch, scan_layers, sharded):
  del as_on_hopper
  calls = 1 if scan_layers else model_config("palimpsa_d", "tiny").num_layers
  # The backward recomputes the chunk-boundary states (the op's residuals), not the readout.
  assert gradient_kernel_calls(scan_layers, sharded) == (calls, 2 * calls)
  monkeypatch.setattr(language_model, "REMAT_POLICY", None)  # remat of everything
  assert gradient_kernel_calls(scan_layers, sharded) == (2 * calls, 2 * calls)
