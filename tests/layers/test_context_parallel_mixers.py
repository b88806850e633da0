"""Every mixer with time split over a sequence axis equals the mixer on one device.

Palimpsa-D, NotPalimpsa, MetaMamba2 and Mamba2 run the context-parallel op and convolution
halo; Gated DeltaNet and attention are partitioned by XLA. A fresh process with 8 fake CPU devices.
"""

import pytest

_SCRIPT = """
import chex, jax, jax.numpy as jnp, numpy as np
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
      bound = 1e-5 * max(1.0, float(np.abs(np.asarray(b)).max()))
      chex.assert_trees_all_close(a, b, rtol=0.0, atol=bound,
                                  custom_message=str((name, mesh_name)))
print("ok")
"""


def _run(run_on_cpu_devices, models):
  result = run_on_cpu_devices(_SCRIPT.replace("{models!r}", repr(models)), 8, timeout=600)
  assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.slow
def test_palimpsa_family_mixers_equal_one_device(run_on_cpu_devices):
  _run(run_on_cpu_devices, ["palimpsa_d", "not_palimpsa", "meta_mamba2", "mamba2"])


@pytest.mark.slow
def test_gated_deltanet_and_attention_equal_one_device(run_on_cpu_devices):
  _run(run_on_cpu_devices, ["gated_deltanet", "transformer"])
