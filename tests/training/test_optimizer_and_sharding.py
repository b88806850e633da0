"""Optimizer schedule and masks, mesh shapes, logical-axis rules, train-state shardings."""

import chex
from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import pytest
from jax.sharding import PartitionSpec as P

from tests.training import tiny_lm
from palimpsa_jax import models
from palimpsa_jax.ops import kernel_sharding
from palimpsa_jax.training import optimizer as optimizer_lib
from palimpsa_jax.training import sharding as sharding_lib
from palimpsa_jax.training import state as state_lib


def _optimizer_config(**overrides):
  config = ml_collections.ConfigDict(dict(
      learning_rate=1e-2, warmup_fraction=1 / 11, decay_steps=None, end_fraction=0.1,
      b1=0.9, b2=0.95, eps=1e-15, weight_decay=0.1, clip_norm=1.0))
  config.update(overrides)
  return config


def test_schedule_warmup_then_cosine_to_end_fraction():
  schedule = optimizer_lib.learning_rate_schedule(_optimizer_config(), 110)
  assert float(schedule(0)) == 0.0
  assert float(schedule(5)) == pytest.approx(5e-3)
  assert float(schedule(10)) == pytest.approx(1e-2)
  assert float(schedule(60)) == pytest.approx(0.55e-2, rel=1e-5)
  assert float(schedule(110)) == pytest.approx(1e-3)
  extended = optimizer_lib.learning_rate_schedule(_optimizer_config(decay_steps=220), 110)
  assert float(extended(110)) > 5e-3


def test_weight_decay_mask_and_clipping():
  params = {"kernel": jnp.ones((2, 2)), "A_log": jnp.ones((2,))}
  tx = optimizer_lib.make_optimizer(
      _optimizer_config(warmup_fraction=0.0, learning_rate=1.0, end_fraction=1.0), 10,
      models.weight_decay_mask)
  zero = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zero, tx.init(params), params)
  chex.assert_trees_all_close(updates["kernel"], -0.1, rtol=1e-7)  # Decayed: -lr * wd * p.
  chex.assert_trees_all_close(updates["A_log"], 0.0, rtol=1e-7)  # Excluded from decay.
  big = jax.tree.map(lambda p: 1e6 * jnp.ones_like(p), params)
  clip = optimizer_lib.make_optimizer(_optimizer_config(), 10, None)
  state = clip.init(params)
  clipped, _ = clip.update(big, state, params)
  chex.assert_tree_all_finite(clipped)


def test_mesh_shape_rest_axis_and_errors():
  mesh = lambda **kw: ml_collections.ConfigDict({"data": 1, "fsdp": 1, "tensor": 1, **kw})
  assert sharding_lib.mesh_shape(mesh(data=-1, tensor=2), 8) == (4, 1, 1, 2)
  assert sharding_lib.mesh_shape(mesh(fsdp=-1), 1) == (1, 1, 1, 1)
  assert sharding_lib.mesh_shape(mesh(data=-1, sequence=4), 8) == (2, 1, 4, 1)
  with pytest.raises(ValueError, match="at most one"):
    sharding_lib.mesh_shape(mesh(data=-1, fsdp=-1), 4)
  with pytest.raises(ValueError, match="not a multiple"):
    sharding_lib.mesh_shape(mesh(data=-1, tensor=3), 4)
  with pytest.raises(ValueError, match="needs 2 devices"):
    sharding_lib.mesh_shape(mesh(data=2), 1)
  with pytest.raises(ValueError, match="mesh axes"):
    sharding_lib.rules_from_config(ml_collections.ConfigDict({"rules": (("embed", "x"),)}))


def test_mesh_context_places_a_step_from_the_mesh_config():
  """mesh_context: the mesh of the config's sizes, its rules and the kernel context; a
  forced context-parallel path takes the "length" axis even at size 1."""
  config = ml_collections.ConfigDict({"sequence": 1, "rules": [("heads", None)]})
  placement = sharding_lib.mesh_context(config, jax.devices()[:1])
  assert dict(placement.mesh.shape) == dict(data=1, fsdp=1, sequence=1, tensor=1)
  assert dict(placement.rules)["heads"] is None
  with placement.kernel_context():
    current = kernel_sharding.current()
    assert (current.batch_axes, current.head_axes) == (sharding_lib.BATCH_AXES, ())
    assert current.sequence_axis is None
  forced = sharding_lib.mesh_context(config, jax.devices()[:1], context_parallel=True)
  with forced.kernel_context():
    assert kernel_sharding.current().sequence_axis == "sequence"
  with pytest.raises(ValueError, match='map "length"'):
    sharding_lib.kernel_context(placement.mesh, [("length", None)], context_parallel=True)


def test_logical_to_spec_uses_divisible_axes_once():
  mesh = jax.sharding.AbstractMesh((1, 2, 1, 2), sharding_lib.MESH_AXES)
  rules = sharding_lib.DEFAULT_RULES
  assert sharding_lib.logical_to_spec(("vocab", "embed"), (64, 16), mesh, rules) == P(
      "tensor", "fsdp")
  assert sharding_lib.logical_to_spec(("vocab", "embed"), (63, 16), mesh, rules) == P(
      None, "fsdp")
  assert sharding_lib.logical_to_spec(("heads", "mlp"), (4, 4), mesh, rules) == P(
      "tensor", None)
  assert sharding_lib.logical_to_spec(None, (3,), mesh, rules) == P()
  with pytest.raises(ValueError, match="do not match"):
    sharding_lib.logical_to_spec(("embed",), (2, 2), mesh, rules)


def test_optimizer_moments_follow_parameter_shardings():
  mesh_config = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})
  mesh = sharding_lib.make_mesh(mesh_config)
  spec = state_lib.make_train_state_spec(
      lambda rngs: tiny_lm.TinyLM(tiny_lm.VOCAB, 8, rngs), 0,
      lambda _: optimizer_lib.make_optimizer(_optimizer_config(), 10, tiny_lm.decay_mask),
      mesh, sharding_lib.DEFAULT_RULES)
  state = spec.init()
  param_leaves = jax.tree.leaves(state["params"])
  moment_shapes = [x.shape for x in jax.tree.leaves(state["opt_state"]) if x.ndim]
  assert sorted(moment_shapes) == sorted([p.shape for p in param_leaves] * 2)
  assert jax.tree.structure(spec.abstract) == jax.tree.structure(state)
  assert int(state["step"]) == 0
  with nnx.use_eager_sharding(False):
    model = models.merge_model(spec.parts.graphdef, state["params"], state["model_state"])
  assert model(jnp.zeros((1, 4), jnp.int32)).shape == (1, 4, tiny_lm.VOCAB)
