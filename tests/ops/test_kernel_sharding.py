"""Kernels under kernel_sharding run on per-device shards and give the global result."""

import dataclasses

import chex
import jax
from jax.sharding import NamedSharding, PartitionSpec
import numpy as np
import pytest

from palimpsa_jax.ops import kernel_sharding
from palimpsa_jax.ops.palimpsa import implementations, palimpsa

# Runs in a subprocess with 4 CPU devices: mesh data 2 x tensor 2; the batch is
# sharded over data, the heads over tensor.
_SCRIPT = """
import chex, dataclasses, jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from palimpsa_jax.ops import kernel_sharding
from palimpsa_jax.ops.palimpsa import implementations, palimpsa
assert jax.device_count() == 4
IMPL = {impl!r}
seen = []
original = implementations.IMPLEMENTATIONS[IMPL]
def recording(q, *args, **kwargs):
  seen.append(q.shape)
  return original.fn(q, *args, **kwargs)
implementations.IMPLEMENTATIONS[IMPL] = dataclasses.replace(original, fn=recording)

B, T, H, K, V = 4, 24, 4, 16, 16
rng = np.random.default_rng(0)
q, k = (jnp.asarray(rng.normal(size=(B, T, H, K)), jnp.float32) for _ in range(2))
v = jnp.asarray(rng.normal(size=(B, T, H, V)), jnp.float32)
beta = jnp.asarray(rng.uniform(0, 1, (B, T, H, V)), jnp.float32)
log_alpha = jnp.asarray(-rng.uniform(0, 0.3, (B, T, H)), jnp.float32)
ip = jnp.asarray(rng.uniform(0.5, 2, (H,)), jnp.float32)
segments = jnp.asarray(np.repeat([[0, 1]], B, 0).repeat(T // 2, 1), jnp.int32)

def loss(q, k, v, beta, log_alpha, impl):
  r = palimpsa(q, k, v, beta, log_alpha, ip, segment_ids=segments, return_variance=True,
               implementation=impl, chunk_size=16, interpret=True)
  return jnp.sum(r.out * r.out) + jnp.sum(r.variance) + jnp.sum(r.state.mu), r

mesh = jax.make_mesh((2, 2), ("data", "tensor"),
                     axis_types=(jax.sharding.AxisType.Auto,) * 2)
put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
args = (put(q, P("data", None, "tensor")), put(k, P("data", None, "tensor")),
        put(v, P("data", None, "tensor")), put(beta, P("data", None, "tensor")),
        put(log_alpha, P("data", None, "tensor")))
step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True),
               static_argnums=5)
with kernel_sharding.kernel_sharding(mesh, batch_axes=("data",), head_axes=("tensor",)):
  (value, result), grads = step(*args, IMPL)
assert set(seen) == {{(B // 2, T, H // 2, K)}}, seen
(ref_value, ref_result), ref_grads = step(q, k, v, beta, log_alpha, "sequential")
chex.assert_trees_all_close(value, ref_value, rtol=1e-5)
for a, b in zip(jax.tree.leaves((result, grads)), jax.tree.leaves((ref_result, ref_grads))):
  chex.assert_trees_all_close(a, b, rtol=1e-4, atol=1e-5 * max(1.0, float(jnp.abs(b).max())))
import warnings
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  with kernel_sharding.kernel_sharding(mesh, batch_axes=("data",), head_axes=("tensor",)):
    odd = (q[:3, :, :3], k[:3, :, :3], v[:3, :, :3], beta[:3, :, :3], log_alpha[:3, :, :3])
    seen.clear()
    jax.jit(lambda *a: palimpsa(*a, ip[:3], implementation=IMPL, chunk_size=16,
                                interpret=True).out)(*odd)
assert seen == [(3, T, 3, K)], seen
assert any("do not divide" in str(w.message) for w in caught), [str(w.message) for w in caught]
print("ok")
"""


@pytest.mark.parametrize("implementation", ["pallas_gpu", "pallas_tpu"])
def test_kernel_runs_per_shard_and_matches_the_reference(implementation, run_on_cpu_devices):
  result = run_on_cpu_devices(_SCRIPT.format(impl=implementation), 4, timeout=600)
  assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_axes_that_do_not_divide_are_dropped_and_bad_axes_rejected():
  mesh = jax.make_mesh((1,), ("data",))
  calls = []

  def kernel(x, y):
    calls.append(x.shape)
    return x + 1, None

  x = np.zeros((3, 2), np.float32)
  with kernel_sharding.kernel_sharding(mesh, batch_axes=("data",)):
    out, none = kernel_sharding.shard_kernel(kernel, (x, None), ("b.", "b."),
                                             ("b.", None), batch_size=3, num_heads=1)
  assert none is None and calls == [(3, 2)]
  chex.assert_trees_all_equal(out, x + 1)
  assert kernel_sharding.current() is None
  with pytest.raises(ValueError, match="'fsdp' is not in the mesh"):
    with kernel_sharding.kernel_sharding(mesh, batch_axes=("fsdp",)):
      pass


@pytest.mark.gpu
def test_compiled_kernel_per_gpu_shard():
  """On 2+ GPUs: the compiled kernel runs on [B / n, ...] and matches the chunked op."""
  if jax.default_backend() != "gpu" or jax.device_count() < 2:
    pytest.skip("needs 2 or more GPUs")
  n = jax.device_count()
  b, t, h, kd, vd = 2 * n, 256, 4, 48, 48
  keys = jax.random.split(jax.random.key(0), 5)
  q, k = (jax.random.normal(keys[i], (b, t, h, kd)) / 7 for i in range(2))
  v = jax.random.normal(keys[2], (b, t, h, vd))
  beta = jax.random.uniform(keys[3], (b, t, h, vd))
  log_alpha = -jax.random.uniform(keys[4], (b, t, h), maxval=0.2)
  ip = jax.numpy.ones((h,))
  mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  batch = NamedSharding(mesh, PartitionSpec("data"))
  sharded = [jax.device_put(x, batch) for x in (q, k, v, beta, log_alpha)]
  seen = []
  original = implementations.IMPLEMENTATIONS["pallas_gpu"]

  def recording(q, *args, **kwargs):
    seen.append(q.shape)
    return original.fn(q, *args, **kwargs)

  def loss(impl, *args):
    return jax.numpy.sum(palimpsa(*args, ip, implementation=impl).out ** 2)

  step = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3, 4, 5)), static_argnums=0)
  with pytest.MonkeyPatch.context() as patch:
    patch.setitem(implementations.IMPLEMENTATIONS, "pallas_gpu",
                  dataclasses.replace(original, fn=recording))
    with kernel_sharding.kernel_sharding(mesh, batch_axes=("data",)):
      value, grads = step("pallas_gpu", *sharded)
  assert set(seen) == {(b // n, t, h, kd)}
  ref_value, ref_grads = step("chunked", q, k, v, beta, log_alpha)
  chex.assert_trees_all_close(value, ref_value, rtol=1e-4)
  for got, want in zip(grads, ref_grads):
    chex.assert_trees_all_close(got, want, rtol=1e-3, atol=1e-4 * float(jax.numpy.abs(want).max()))
