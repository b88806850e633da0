"""Train and eval steps: loss at the target positions, tracing inside the kernel context."""

import contextlib

from flax import nnx
import jax
import numpy as np
import optax
import pytest

from palimpsa_jax import models
from palimpsa_jax.data import mqar
from palimpsa_jax.ops import kernel_sharding
from palimpsa_jax.training import sharding as sharding_lib
from palimpsa_jax.training import state as state_lib
from palimpsa_jax.training import steps as steps_lib

LENGTH, PAIRS, VOCAB = 32, 4, 64


@pytest.fixture(scope="module")
def setup():
  config = models.mqar_model_config("palimpsa_d", d_model=32, vocab_size=VOCAB,
                                    dtype="float32", chunk_size=8)
  graphdef, params, model_state = state_lib.split_model(
      models.build_model(config, nnx.Rngs(0)))
  inputs, targets = mqar.multiquery_ar(VOCAB, 6, LENGTH, PAIRS, seed=1)
  batch = {"tokens": inputs, "targets": targets}
  return graphdef, params, model_state, batch


def test_eval_sums_at_target_positions_equal_full_sums(setup):
  graphdef, params, model_state, batch = setup
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  eval_step = steps_lib.make_eval_step(graphdef, sharding)
  full = eval_step(params, model_state, batch)
  positions = mqar.target_positions(batch["targets"])
  assert positions.shape == (6, PAIRS)
  gathered = eval_step(params, model_state, {**batch, "positions": positions})
  np.testing.assert_allclose(gathered, full, rtol=1e-6)
  assert float(full[2]) == 6 * PAIRS


def test_steps_are_traced_inside_the_kernel_context(setup):
  graphdef, params, model_state, batch = setup
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  seen = []

  @contextlib.contextmanager
  def context():
    seen.append("enter")
    yield
    seen.append("exit")

  eval_step = steps_lib.make_eval_step(graphdef, sharding, context)
  eval_step(params, model_state, batch)
  eval_step(params, model_state, batch)  # Cached: not traced again.
  assert seen == ["enter", "exit"]
  mesh = jax.make_mesh((1, 1, 1, 1), sharding_lib.MESH_AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * 4)
  with sharding_lib.kernel_context(mesh, sharding_lib.DEFAULT_RULES)():
    current = kernel_sharding.current()
  assert (current.batch_axes, current.head_axes) == (("data", "fsdp"), ("tensor",))
  assert kernel_sharding.current() is None


def test_take_positions_matches_indexing():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, 10, 4)).astype(np.float32)
  ints = rng.integers(-100, 100, size=(3, 10)).astype(np.int32)
  positions = np.sort(rng.choice(10, size=(3, 5)), axis=1).astype(np.int32)
  np.testing.assert_array_equal(models.take_positions(x, positions),
                                np.take_along_axis(x, positions[..., None], axis=1))
  np.testing.assert_array_equal(models.take_positions(ints, positions),
                                np.take_along_axis(ints, positions, axis=1))


def test_train_step_at_target_positions_equals_full(setup):
  graphdef, params, model_state, batch = setup
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  tx = optax.sgd(1e-2)  # Adam would amplify rounding in near-zero gradients.
  shardings = jax.tree.map(lambda _: sharding,
                           {"step": 0, "params": params, "model_state": model_state,
                            "opt_state": tx.init(params)})
  train_step = steps_lib.make_train_step(graphdef, tx, optax.constant_schedule(1e-2),
                                         shardings, sharding)

  def fresh_state():
    copy = jax.tree.map(np.array, params)
    return {"step": np.int32(0), "params": copy, "model_state": model_state,
            "opt_state": tx.init(copy)}

  positions = mqar.target_positions(batch["targets"])
  state_full, metrics_full = train_step(fresh_state(), batch)
  state_gathered, metrics_gathered = train_step(
      fresh_state(), {**batch, "positions": positions})
  for name in ("train/loss", "train/accuracy", "train/grad_norm"):
    np.testing.assert_allclose(metrics_gathered[name], metrics_full[name], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               state_gathered["params"], state_full["params"])
