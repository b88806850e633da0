"""Every mixer with time split over a sequence axis equals the mixer on one device.

Palimpsa-D, NotPalimpsa, MetaMamba2 and Mamba2 run the context-parallel op and convolution
halo; Gated DeltaNet and attention are partitioned by XLA. Subprocess with 8 CPU devices.
"""

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).parents[2]

_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from palimpsa_jax.models import make_mixer, model_config
from palimpsa_jax.ops import kernel_sharding
assert jax.device_count() == 8
B, T = 2, 32
auto = (jax.sharding.AxisType.Auto,)
meshes = {
    "sequence 4": (jax.make_mesh((4,), ("sequence",), axis_types=auto,
                                 devices=jax.devices()[:4]), ()),
    "data 2 x sequence 4": (jax.make_mesh((2, 4), ("data", "sequence"), axis_types=auto * 2),
                            ("data",)),
}
rng = np.random.default_rng(0)
seg = np.zeros((B, T), np.int32)
seg[0, 8:], seg[0, 10:], seg[1, 19:] = 1, 2, 1  # restarts at a border of 8-step shards, inside
seg = jnp.asarray(seg)
for name in {models!r}:
  config = model_config(name, "tiny", dtype="float32", chunk_size=4)
  graphdef, params = nnx.split(make_mixer(config, nnx.Rngs(0)))
  # Noise on every parameter, so that no term is trivially zero.
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  params = jax.tree.unflatten(tree, [x + 0.1 * jax.random.normal(key, x.shape)
                                     for key, x in zip(keys, leaves)])
  x = jnp.asarray(rng.normal(size=(B, T, config.d_model)), jnp.float32)

  def loss(params, x):
    y = nnx.merge(graphdef, params)(x, segment_ids=seg)
    return jnp.sum(y * jnp.cos(y)), y

  step = lambda: jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  want = step()(params, x)
  for mesh_name, (mesh, batch_axes) in meshes.items():
    with kernel_sharding.kernel_sharding(mesh, batch_axes, (), "sequence"):
      got = step()(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      a, b = np.asarray(a), np.asarray(b)
      error = np.abs(a - b).max() / max(1.0, np.abs(b).max())
      assert error < 1e-5, (name, mesh_name, error)
print("ok")
"""


def _run(models):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", _SCRIPT.replace("{models!r}", repr(models))],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.slow
def test_palimpsa_family_mixers_equal_one_device():
  _run(["palimpsa_d", "not_palimpsa", "meta_mamba2", "mamba2"])


@pytest.mark.slow
def test_gated_deltanet_and_attention_equal_one_device():
  _run(["gated_deltanet", "transformer"])
