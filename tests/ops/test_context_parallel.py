"""The Palimpsa op with time split over a sequence axis equals the op on one device.

Each case runs in a fresh process with 8 fake CPU devices (chex.set_n_cpu_devices); meshes of 4 and 8 devices.
"""


import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from palimpsa_jax.ops import context_parallel
from palimpsa_jax.ops import kernel_sharding

_SCRIPT = """
import chex, jax, jax.numpy as jnp, numpy as np
from palimpsa_jax.ops import kernel_sharding
from palimpsa_jax.ops.palimpsa import palimpsa, PalimpsaState
assert jax.device_count() == 8
CASES, GRADS = {cases!r}, {grads!r}
from tests.ops.palimpsa import palimpsa_suite
# Segments: row 0 restarts exactly at the border of 8-step (and 16-step) shards and inside
# one; its third segment spans several shards. Row 1 restarts inside shards only.
x = palimpsa_suite.make_inputs(0, (2, 64, 2, 4, 4),
                               segment_lengths=[[16, 5, 27, 16], [5, 38, 21]])
q, k, v, beta, log_alpha, ip, mu0, prec0, seg = (
    jnp.asarray(x[name]) for name in ("q", "k", "v", "beta", "log_alpha", "prior_precision",
                                      "mu0", "precision0", "segment_ids"))

def loss(q, k, v, beta, log_alpha, mu0, prec0, impl, use_beta, use_init):
  r = palimpsa(q, k, v, beta if use_beta else None, log_alpha, ip,
               initial_state=PalimpsaState(mu0, prec0) if use_init else None,
               segment_ids=seg, return_variance=True, implementation=impl, chunk_size=4,
               interpret=True)
  value = (jnp.sum(r.out * jnp.cos(r.out)) + jnp.sum(jnp.sin(r.variance))
           + jnp.sum(r.state.mu ** 2) + jnp.sum(jnp.log(r.state.precision)))
  return value, r

def compiled(grads):
  if grads:
    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7)), has_aux=True),
                   static_argnums=(7, 8, 9))
  return jax.jit(lambda *a: (loss(*a), ()), static_argnums=(7, 8, 9))

auto = (jax.sharding.AxisType.Auto,)
meshes = {{
    "sequence 4": (jax.make_mesh((4,), ("sequence",), axis_types=auto,
                                 devices=jax.devices()[:4]), (), ()),
    "sequence 8": (jax.make_mesh((8,), ("sequence",), axis_types=auto), (), ()),
    "data 2 x sequence 4": (jax.make_mesh((2, 4), ("data", "sequence"), axis_types=auto * 2),
                            ("data",), ()),
    "sequence 4 x tensor 2": (jax.make_mesh((4, 2), ("sequence", "tensor"),
                                            axis_types=auto * 2), (), ("tensor",)),
}}
args = (q, k, v, beta, log_alpha, mu0, prec0)
for impl, name, use_beta, use_init in CASES:
  mesh, batch_axes, head_axes = meshes[name]
  (want_value, want_result), want_grads = compiled(GRADS)(*args, "sequential", use_beta,
                                                          use_init)
  with kernel_sharding.kernel_sharding(mesh, batch_axes, head_axes, "sequence"):
    (value, result), grads = compiled(GRADS)(*args, impl, use_beta, use_init)
  for got, want in zip(jax.tree.leaves((value, result, grads)),
                       jax.tree.leaves((want_value, want_result, want_grads))):
    bound = 1e-5 * max(1.0, float(np.abs(np.asarray(want)).max()))
    chex.assert_trees_all_close(got, want, rtol=0.0, atol=bound,
                                custom_message=str((impl, name, use_beta, use_init)))
print("ok")
"""


def _run(run_on_cpu_devices, cases, grads=True):
  script = _SCRIPT.format(cases=cases, grads=grads)
  result = run_on_cpu_devices(script, 8, timeout=600)
  assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


# (implementation, mesh, beta given, initial state given): beta=None from the prior runs
# the SimpleGLA path, beta=None from a state the general path with beta = 0.
_BOTH = [(True, True), (False, False), (False, True), (True, False)]


def test_chunked_equals_one_device(run_on_cpu_devices):
  """Values and gradients (q, k, v, beta, log_alpha, initial state) within 1e-5."""
  _run(run_on_cpu_devices, [("chunked", "sequence 8", True, True), ("chunked", "data 2 x sequence 4", False, False)])


@pytest.mark.slow
def test_every_path_and_mesh_equals_one_device(run_on_cpu_devices):
  _run(run_on_cpu_devices, [("chunked", "sequence 8", *c) for c in _BOTH[1:]]
       + [("chunked", mesh, True, True) for mesh in ("sequence 4", "sequence 4 x tensor 2")]
       + [("sequential", "data 2 x sequence 4", True, True),
          ("sequential", "sequence 4", False, True)])
  # associative_scan's gradient inside a shard_map crashes the XLA:CPU compiler: values.
  _run(run_on_cpu_devices, [("associative", "sequence 8", True, True)], grads=False)


@pytest.mark.slow
def test_pallas_kernels_equal_one_device(run_on_cpu_devices):
  """The kernels (interpret mode) run per time shard through the same path."""
  _run(run_on_cpu_devices, [("pallas_gpu", "sequence 4 x tensor 2", True, True),
        ("pallas_tpu", "data 2 x sequence 4", True, False)])


def test_sequence_axis_size_one_runs_the_path_and_bad_axes_are_rejected():
  mesh = jax.make_mesh((1,), ("sequence",), axis_types=(jax.sharding.AxisType.Auto,))
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 6, 1, 2)), jnp.float32) for _ in range(3))
  log_alpha = jnp.full((1, 6, 1), -0.1)
  from palimpsa_jax.ops.palimpsa import palimpsa  # pylint: disable=g-import-not-at-top
  want = palimpsa(q, k, v, v * v, log_alpha, jnp.ones((1,)), implementation="sequential")
  with kernel_sharding.kernel_sharding(mesh, (), (), "sequence"):
    assert context_parallel.active().sequence_axis == "sequence"
    got = jax.jit(lambda *a: palimpsa(*a, jnp.ones((1,)), implementation="sequential"))(
        q, k, v, v * v, log_alpha)
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)
  fake = kernel_sharding.KernelSharding(
      jax.sharding.AbstractMesh((2,), ("sequence",)), (), (), "sequence")
  with pytest.raises(ValueError, match="sequence axis 'sequence' of size 2 does not divide"):
    context_parallel._shards(fake, 3, "q")  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="'sequence' is also a batch or head axis"):
    with kernel_sharding.kernel_sharding(mesh, ("sequence",), (), "sequence"):
      pass
