"""Train and eval steps: loss at the target positions, tracing inside the kernel context,
one trace per step for batches of one shape."""

import contextlib

import chex
from flax import nnx
import jax
import numpy as np
import optax
import pytest

from palimpsa_jax import models
from palimpsa_jax.data import mqar
from palimpsa_jax.ops import kernel_sharding
from palimpsa_jax.ops.token_loss import logits_token_loss, sliced
from palimpsa_jax.training import objective as objective_lib
from palimpsa_jax.training import sharding as sharding_lib
from palimpsa_jax.training import steps as steps_lib
from tests.ops.numerics import assert_close_to_reference

LENGTH, PAIRS, VOCAB = 32, 4, 64


@pytest.fixture(scope="module")
def setup():
  config = models.mqar_model_config("palimpsa_d", d_model=32, vocab_size=VOCAB,
                                    dtype="float32", chunk_size=8)
  graphdef, params, model_state = models.split_model(
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
  chex.assert_trees_all_close(gathered, full, rtol=1e-6)
  assert float(objective_lib.count(full)) == 6 * PAIRS


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
  """Exact values and gradients: float32 from 2^-96 up (all 24 significant bits, through
  bfloat16 pieces), bfloat16, ints."""
  rng = np.random.default_rng(0)
  bits = ((rng.integers(31, 254, size=(3, 10, 4)).astype(np.uint32) << 23)
          | rng.integers(0, 1 << 23, size=(3, 10, 4)).astype(np.uint32)
          | (rng.integers(0, 2, size=(3, 10, 4)).astype(np.uint32) << 31))
  x = bits.view(np.float32)
  ints = rng.integers(-100, 100, size=(3, 10)).astype(np.int32)
  positions = np.sort([rng.choice(10, 5, replace=False) for _ in range(3)]).astype(np.int32)
  for values in (x, x.astype(jax.numpy.bfloat16)):
    chex.assert_trees_all_equal(jax.jit(models.take_positions)(values, positions),
                                np.take_along_axis(values, positions[..., None], axis=1))
  chex.assert_trees_all_equal(models.take_positions(ints, positions),
                              np.take_along_axis(ints, positions, axis=1))
  cotangent = rng.normal(size=(3, 5, 4)).astype(np.float32)
  grad = jax.jit(jax.grad(
      lambda x: jax.numpy.sum(models.take_positions(x, positions) * cotangent)))(x)
  expected = np.zeros_like(x)
  for row in range(3):
    expected[row, positions[row]] = cotangent[row]
  chex.assert_trees_all_equal(grad, expected)


def _train_step_and_state(graphdef, params, model_state):
  """(jitted SGD train step on one device, () -> a fresh train state for it)."""
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  tx = optax.sgd(1e-2)  # Adam would amplify rounding in near-zero gradients.
  shardings = jax.tree.map(lambda _: sharding,
                           {"step": 0, "params": params, "model_state": model_state,
                            "opt_state": tx.init(params)})
  train_step = steps_lib.make_train_step(graphdef, tx, optax.constant_schedule(1e-2),
                                         objective_lib.Objective(), shardings, sharding)

  def fresh_state():
    copy = jax.tree.map(np.array, params)
    return {"step": np.int32(0), "params": copy, "model_state": model_state,
            "opt_state": tx.init(copy)}

  return train_step, fresh_state


def test_train_step_at_target_positions_equals_full(setup):
  graphdef, params, model_state, batch = setup
  train_step, fresh_state = _train_step_and_state(graphdef, params, model_state)
  positions = mqar.target_positions(batch["targets"])
  state_full, metrics_full = train_step(fresh_state(), batch)
  state_gathered, metrics_gathered = train_step(
      fresh_state(), {**batch, "positions": positions})
  names = ("train/loss", "train/accuracy", "train/grad_norm")
  chex.assert_trees_all_close({n: metrics_gathered[n] for n in names},
                              {n: metrics_full[n] for n in names}, rtol=1e-5)
  chex.assert_trees_all_close(state_gathered["params"], state_full["params"], rtol=1e-5,
                              atol=1e-7)


@pytest.fixture
def at_most_one_trace(monkeypatch):
  """Every step the step makers build fails (AssertionError) when jit traces it twice."""
  chex.clear_trace_counter()
  traced_within = steps_lib._traced_within
  monkeypatch.setattr(steps_lib, "_traced_within", lambda context, fn: chex.assert_max_traces(
      traced_within(context, fn), n=1))


def _batches(lengths):
  """MQAR batches (6 rows, fresh data each) of the given sequence lengths."""
  for seed, length in enumerate(lengths):
    inputs, targets = mqar.multiquery_ar(VOCAB, 6, length, PAIRS, seed=10 + seed)
    yield {"tokens": inputs, "targets": targets}


def test_train_and_eval_steps_are_traced_once(setup, at_most_one_trace):
  """New batches of one shape and the updated state reuse the compiled steps; a batch of
  another length retraces them, which the guard turns into a failure."""
  graphdef, params, model_state, _ = setup
  train_step, fresh_state = _train_step_and_state(graphdef, params, model_state)
  eval_step = steps_lib.make_eval_step(graphdef, jax.sharding.SingleDeviceSharding(
      jax.devices()[0]))
  state = fresh_state()
  *batches, shorter = _batches([LENGTH] * 3 + [LENGTH - 8])
  for batch in batches:
    state, metrics = train_step(state, batch)
    sums = eval_step(state["params"], state["model_state"], batch)
  assert int(state["step"]) == 3
  chex.assert_tree_all_finite((metrics, sums))
  with pytest.raises(AssertionError, match="traced > 1 times"):
    train_step(state, shorter)
  with pytest.raises(AssertionError, match="traced > 1 times"):
    eval_step(params, model_state, shorter)


def test_train_loss_and_gradients_equal_those_of_the_whole_logits(setup, monkeypatch):
  """The step's sliced token loss (2 slices here) against the loss of the model's logits."""
  graphdef, params, model_state, batch = setup
  monkeypatch.setattr(sliced, "SLICE_LOGITS", 6 * (LENGTH // 2) * VOCAB)
  assert sliced.num_slices(6, LENGTH, VOCAB) == 2

  def whole_logits(p):
    model = models.merge_model(graphdef, p, model_state)
    return objective_lib.metric_sums(logits_token_loss(
        model(batch["tokens"]), batch["targets"], batch["targets"] != mqar.IGNORE_INDEX))

  def sliced_sums(p):
    return steps_lib.eval_sums(graphdef, p, model_state, batch)

  def value_and_grad(fn):
    def loss_and_sums(p):
      sums = fn(p)
      return sums[0], sums
    return jax.jit(jax.value_and_grad(loss_and_sums, has_aux=True))(params)

  (loss, sums), grads = value_and_grad(sliced_sums)
  (ref_loss, ref_sums), ref_grads = value_and_grad(whole_logits)
  chex.assert_trees_all_close(loss, ref_loss, rtol=1e-6)
  chex.assert_trees_all_equal(sums[1:], ref_sums[1:])
  assert_close_to_reference(grads, ref_grads, 1e-5)
