"""token_loss (every implementation) and logits_token_loss against the float64 reference:
values, argmax hits with ties, log-sum-exps, weights and the gradients of a weighted sum of nll
and lse^2, under masks and float weights."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from palimpsa_jax.ops.token_loss import head_logits, logits_token_loss, token_loss
from palimpsa_jax.ops.token_loss import implementations, sliced
from palimpsa_jax.ops.token_loss.reference import logits_reference, token_loss_reference
from tests.ops.numerics import BFLOAT16_TOL, FLOAT32_TOL, GRAD_TOL, assert_close_to_reference

BATCH, LENGTH, DIM, VOCAB = 3, 12, 16, 40
TIED_FIRST, TIED_SECOND = 7, 29  # Two equal rows of the table: their logits tie everywhere.
UNCOUNTED_TARGET = -100  # Outside [0, vocab): an uncounted target must never be read.
LSE_COEFFICIENT = 0.1  # The differentiated total's lse^2 term (as a z-loss would add one).


def _inputs(dtype, weights_kind: str, seed: int = 0):
  """(h, table, targets, weights) with ties at positions (0, 0) and (0, 1) and uncounted
  positions holding out-of-range targets."""
  rng = np.random.default_rng(seed)
  h = rng.standard_normal((BATCH, LENGTH, DIM))
  table = 0.5 * rng.standard_normal((VOCAB, DIM))
  # Positions (0, 0) and (0, 1) see the two tied rows as their largest logits.
  top = 4.0 * h[0, 0] / np.linalg.norm(h[0, 0])
  table[TIED_FIRST] = table[TIED_SECOND] = top
  h[0, 1] = h[0, 0]
  targets = rng.integers(0, VOCAB, (BATCH, LENGTH))
  targets[0, 0], targets[0, 1] = TIED_FIRST, TIED_SECOND  # a hit; a tie lost to the first
  counted = rng.uniform(size=(BATCH, LENGTH)) > 0.3
  counted[0, :2] = True
  targets = np.where(counted, targets, UNCOUNTED_TARGET)
  if weights_kind == "mask":
    weights = jnp.asarray(counted)
  else:
    weights = jnp.asarray(np.where(counted, rng.uniform(0.5, 2.0, counted.shape), 0.0),
                          jnp.float32)
  return (jnp.asarray(h, dtype), jnp.asarray(table, dtype), jnp.asarray(targets, jnp.int32),
          weights)


def _total(loss) -> jax.Array:
  """A weighted sum of both differentiable outputs: every cotangent path is tested."""
  return jnp.sum(loss.weights * (loss.nll + LSE_COEFFICIENT * loss.lse ** 2))


def _value_and_grads(loss_fn, h, table, targets, weights):
  """(TokenLoss, (d total / dh, d total / d table)), jitted."""
  def total(h, table):
    loss = loss_fn(h, table, targets, weights)
    return _total(loss), loss
  (_, loss), grads = jax.jit(jax.value_and_grad(total, argnums=(0, 1), has_aux=True))(h, table)
  return loss, grads


def _reference(h, table, targets, weights):
  """The float64 reference's TokenLoss and gradients, as numpy arrays."""
  with jax.enable_x64(True):
    as64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
    loss, grads = _value_and_grads(token_loss_reference, as64(h), as64(table), targets,
                                   as64(weights))
    return jax.tree.map(np.asarray, (loss, grads))


def _check_against_reference(loss, grads, reference, dtype):
  ref_loss, ref_grads = reference
  chex.assert_trees_all_equal(np.asarray(loss.correct), ref_loss.correct)
  assert bool(loss.correct[0, 0]) and not bool(loss.correct[0, 1])  # the first of a tie wins
  np.testing.assert_allclose(loss.weights, ref_loss.weights, rtol=1e-7)
  # Values: float32 logits from either dtype's inputs (bfloat16 inputs are exact in the
  # reference too), so float32's tolerance holds for both.
  assert_close_to_reference({"nll": loss.nll, "lse": loss.lse},
                            {"nll": ref_loss.nll, "lse": ref_loss.lse}, FLOAT32_TOL)
  tol = GRAD_TOL if dtype == jnp.float32 else BFLOAT16_TOL
  assert_close_to_reference({"dh": grads[0], "d_table": grads[1]},
                            {"dh": ref_grads[0], "d_table": ref_grads[1]}, tol)
  assert [g.dtype for g in grads] == [dtype, dtype]


@pytest.mark.parametrize("weights_kind", ["mask", "weights"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("implementation, slice_logits", [
    ("logits", None), ("sliced", None), ("sliced", BATCH * 2 * VOCAB)])
def test_implementations_match_the_float64_reference(implementation, slice_logits, dtype,
                                                     weights_kind, monkeypatch):
  """Every implementation; "sliced" in one slice and in 6 slices of 2 positions a row."""
  if slice_logits is not None:
    monkeypatch.setattr(sliced, "SLICE_LOGITS", slice_logits)
  expected_slices = 1 if slice_logits is None else LENGTH // 2
  assert sliced.num_slices(BATCH, LENGTH, VOCAB) == expected_slices
  inputs = _inputs(dtype, weights_kind)
  loss, grads = _value_and_grads(
      lambda *args: token_loss(*args, implementation=implementation), *inputs)
  _check_against_reference(loss, grads, _reference(*inputs), dtype)
  uncounted = ~np.asarray(inputs[3] != 0)
  assert not np.any(np.asarray(loss.nll)[uncounted])
  assert not np.any(np.asarray(loss.correct)[uncounted])


def test_the_table_holds_the_tested_implementations():
  assert set(implementations.IMPLEMENTATIONS) == {"logits", "sliced"}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_logits_token_loss_matches_the_reference(dtype):
  h, table, targets, weights = _inputs(jnp.float32, "weights")
  logits = jnp.einsum("btd,vd->btv", h, table, precision="highest").astype(dtype)

  def value_and_grad(fn, logits, weights):
    def total(logits):
      loss = fn(logits, targets, weights)
      return _total(loss), loss
    return jax.jit(jax.value_and_grad(total, has_aux=True))(logits)

  (_, loss), grad = value_and_grad(logits_token_loss, logits, weights)
  with jax.enable_x64(True):
    (_, ref), ref_grad = value_and_grad(
        logits_reference, jnp.asarray(np.asarray(logits, np.float64)),
        jnp.asarray(np.asarray(weights, np.float64)))
    ref, ref_grad = jax.tree.map(np.asarray, (ref, ref_grad))
  chex.assert_trees_all_equal(np.asarray(loss.correct), ref.correct)
  assert bool(loss.correct[0, 0]) and not bool(loss.correct[0, 1])
  assert_close_to_reference({"nll": loss.nll, "lse": loss.lse},
                            {"nll": ref.nll, "lse": ref.lse}, FLOAT32_TOL)
  assert_close_to_reference({"d_logits": grad}, {"d_logits": ref_grad},
                            GRAD_TOL if dtype == jnp.float32 else BFLOAT16_TOL)
  assert grad.dtype == dtype


def test_without_weights_every_target_counts():
  h, table, targets, _ = _inputs(jnp.float32, "mask")
  targets = jnp.where(targets < 0, 0, targets)
  everywhere = token_loss(h, table, targets)
  ones = token_loss(h, table, targets, jnp.ones(targets.shape, bool))
  chex.assert_trees_all_equal(everywhere, ones)
  chex.assert_trees_all_equal(everywhere.weights, jnp.ones(targets.shape))
  from_logits = logits_token_loss(head_logits(h, table), targets)
  assert_close_to_reference({"nll": from_logits.nll}, {"nll": everywhere.nll}, FLOAT32_TOL)


def test_slicing_changes_nothing_in_float64(monkeypatch):
  """float64 inputs: every slicing, and the whole logits, give the same gradients (of nll and
  lse) to 1e-12."""
  rng = np.random.default_rng(0)
  with jax.enable_x64(True):
    h = jnp.asarray(rng.normal(size=(2, 6, 4)))
    table = jnp.asarray(rng.normal(size=(5, 4)))
    targets = jnp.asarray(rng.integers(0, 5, size=(2, 6)))
    grad = lambda fn: jax.grad(lambda h, table: _total(fn(h, table, targets)),
                               argnums=(0, 1))(h, table)
    expected = grad(lambda *a: token_loss_reference(*a, jnp.ones(targets.shape)))
    chex.assert_trees_all_close(grad(lambda *a: token_loss(*a, implementation="logits")),
                                expected, rtol=1e-12, atol=1e-12)
    for budget, slices in ((1 << 24, 1), (2 * 3 * 5, 2), (2 * 5, 6)):
      monkeypatch.setattr(sliced, "SLICE_LOGITS", budget)
      assert sliced.num_slices(2, 6, 5) == slices
      chex.assert_trees_all_close(grad(token_loss), expected, rtol=1e-12, atol=1e-12)


def test_slices_divide_the_length_within_the_budget():
  assert sliced.num_slices(128, 128, 8192) == 8  # MQAR's paper setting.
  assert sliced.num_slices(2, 10, 3) == 1
  for batch, length, vocab in [(4, 4096, 32000), (3, 7, 1 << 24), (8, 96, 50277)]:
    count = sliced.num_slices(batch, length, vocab)
    assert length % count == 0
    assert batch * (length // count) * vocab <= sliced.SLICE_LOGITS or count == length


@pytest.mark.parametrize("change, error, message", [
    (lambda a: {**a, "h": a["h"][0]}, ValueError, r"^h must be an array of shape \[B, T, d\]"),
    (lambda a: {**a, "table": a["table"][:, :3]}, ValueError, r"^table must have shape"),
    (lambda a: {**a, "table": a["table"].astype(jnp.bfloat16)}, TypeError,
     r"^table must have h's dtype float32, got bfloat16"),
    (lambda a: {**a, "targets": a["targets"][:, 1:]}, ValueError, r"^targets must have shape"),
    (lambda a: {**a, "targets": a["targets"].astype(jnp.float32)}, TypeError,
     r"^targets must have an integer dtype"),
    (lambda a: {**a, "weights": a["weights"][:, 1:]}, ValueError, r"^weights must have shape"),
    (lambda a: {**a, "weights": a["weights"].astype(jnp.int32)}, TypeError,
     r"^weights must have a floating dtype"),
    (lambda a: {**a, "implementation": "pallas_gpu"}, ValueError,
     r"^implementation must be one of \('auto', 'logits', 'sliced'\), got 'pallas_gpu'"),
])
def test_bad_arguments_are_refused_naming_them(change, error, message):
  h, table, targets, weights = _inputs(jnp.float32, "mask")
  args = change(dict(h=h, table=table, targets=targets, weights=weights,
                     implementation="sliced"))
  with pytest.raises(error, match=message) as raised:
    token_loss(**args)
  assert "\n" not in str(raised.value)


def test_bad_logits_are_refused_naming_them():
  _, _, targets, weights = _inputs(jnp.float32, "mask")
  with pytest.raises(ValueError, match=r"^logits must be an array of shape \[B, T, vocab\]"):
    logits_token_loss(jnp.zeros((BATCH, VOCAB)), targets, weights)
  with pytest.raises(ValueError, match=r"^targets must have shape \[B, T\]"):
    logits_token_loss(jnp.zeros((BATCH, LENGTH + 1, VOCAB)), targets, weights)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_head_logits_gradients_match_autodiff(dtype):
  h = jax.random.normal(jax.random.key(0), (2, 5, 16))
  table = jax.random.normal(jax.random.key(1), (40, 16))
  cot = jax.random.normal(jax.random.key(2), (2, 5, 40))

  def loss(head, h, table):
    return jnp.sum(head(h.astype(dtype), table.astype(dtype)) * cot)

  plain = lambda h, t: jnp.einsum("btd,vd->btv", h, t, preferred_element_type=jnp.float32)
  want = jax.grad(loss, argnums=(1, 2))(plain, h, table)
  got = jax.grad(loss, argnums=(1, 2))(head_logits, h, table)
  tol = 1e-6 if dtype == jnp.float32 else BFLOAT16_TOL
  chex.assert_type(got, jnp.float32)
  for g, w in zip(got, want):
    chex.assert_trees_all_close(g, w, rtol=tol, atol=tol * float(jnp.max(jnp.abs(w))))


@pytest.mark.parametrize("loss", [
    lambda h, t: jnp.sum(head_logits(h, t)),
    lambda h, t: _total(token_loss(h, t, jnp.zeros(h.shape[:2], jnp.int32))),
])
def test_the_backward_matmuls_stay_bf16(loss):
  """The head's backward rounds the logits' cotangent to bf16: its matmuls read bf16."""
  h = jnp.ones((2, 5, 16), jnp.bfloat16)
  table = jnp.ones((40, 16), jnp.bfloat16)
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(h, table)

  def dots(jaxpr):  # dot_general equations, nested jaxprs included
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        yield eqn
      for param in eqn.params.values():
        inner = getattr(param, "jaxpr", param)
        if hasattr(inner, "eqns"):
          yield from dots(inner)

  found = list(dots(jaxpr.jaxpr))
  assert len(found) >= 3  # the forward and both gradients
  for eqn in found:
    assert all(v.aval.dtype == jnp.bfloat16 for v in eqn.invars), eqn
