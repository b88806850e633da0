"""The one objective (training/objective.py): its sums and means, and the rule that every step
and scorer takes its loss and accuracy from it (so a new loss term is a change in one place)."""

import ast
import pathlib

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from palimpsa_jax import models
from palimpsa_jax.data import mqar as mqar_lib
from palimpsa_jax.evaluation import lm as lm_eval
from palimpsa_jax.evaluation import mqar as mqar_eval
from palimpsa_jax.ops.token_loss import TokenLoss
from palimpsa_jax.training import batched
from palimpsa_jax.training import objective as objective_lib
from palimpsa_jax.training import steps as steps_lib
from tests.training import tiny_lm

REPO = pathlib.Path(__file__).parents[2]
# The modules allowed to read a TokenLoss's per-position fields: the op that makes them and
# the objective that turns them into what is minimised and reported.
READERS = ("palimpsa_jax/ops/token_loss/", "palimpsa_jax/training/objective.py")
PER_POSITION_FIELDS = {"nll", "correct", "lse"}


def _token_loss() -> TokenLoss:
  nll = jnp.asarray([[0.5, 2.0, 0.0], [1.0, 3.0, 0.0]])
  correct = jnp.asarray([[True, False, False], [True, True, False]])
  lse = jnp.asarray([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
  weights = jnp.asarray([[1.0, 2.0, 0.0], [0.5, 1.0, 0.0]])
  return TokenLoss(nll, correct, lse, weights)


def test_sums_and_means_are_weighted_over_the_positions_that_count():
  loss = _token_loss()
  sums = objective_lib.metric_sums(loss)
  assert sums.shape == (len(objective_lib.METRICS) + 1,)
  at = {name: float(sums[i]) for i, name in enumerate(objective_lib.METRICS)}
  assert at["loss"] == pytest.approx(0.5 + 4.0 + 0.5 + 3.0)
  assert at["accuracy"] == pytest.approx(1 + 0.5 + 1)
  assert float(objective_lib.count(sums)) == 4.5
  means = objective_lib.means(np.asarray(sums) * 2)  # the sums of two equal batches
  assert tuple(means) == objective_lib.METRICS
  assert float(means["loss"]) == pytest.approx(8.0 / 4.5)
  assert float(means["accuracy"]) == pytest.approx(2.5 / 4.5)
  assert float(objective_lib.Objective()(loss)) == pytest.approx(8.0)
  nothing = objective_lib.means(np.zeros(len(objective_lib.METRICS) + 1))
  assert all(float(v) == 0 for v in nothing.values())  # no count: 0, never NaN


def test_the_objective_of_a_run_config_is_the_cross_entropy():
  objective = objective_lib.Objective.for_run(tiny_lm.tiny_mqar_config())
  loss = _token_loss()
  assert float(objective(loss)) == float(jnp.sum(loss.weights * loss.nll))


def _attribute_reads(path: pathlib.Path) -> list[str]:
  tree = ast.parse(path.read_text(), str(path))
  return [f"{path.relative_to(REPO)}:{node.lineno}: .{node.attr}" for node in ast.walk(tree)
          if isinstance(node, ast.Attribute) and node.attr in PER_POSITION_FIELDS]


def test_only_the_objective_reads_the_per_position_loss():
  """No step, scorer or model sums nll or hits itself: a new term goes into the objective."""
  reads = [read for path in sorted((REPO / "palimpsa_jax").rglob("*.py"))
           if not str(path.relative_to(REPO)).startswith(READERS)
           for read in _attribute_reads(path)]
  assert not reads, ("read the token loss through palimpsa_jax/training/objective.py:\n"
                     + "\n".join(reads))


@pytest.fixture
def calls(monkeypatch):
  """Counts the objective's calls: position_metrics (every metric and score goes through it)
  and Objective.__call__ (what a train step differentiates)."""
  seen = {"position_metrics": 0, "minimised": 0}
  position_metrics, minimised = objective_lib.position_metrics, objective_lib.Objective.__call__

  def counted_metrics(loss):
    seen["position_metrics"] += 1
    return position_metrics(loss)

  def counted_minimised(self, loss):
    seen["minimised"] += 1
    return minimised(self, loss)

  monkeypatch.setattr(objective_lib, "position_metrics", counted_metrics)
  monkeypatch.setattr(objective_lib.Objective, "__call__", counted_minimised)
  tiny_lm.use_tiny_model(monkeypatch)
  return seen


def _tiny_parts():
  with nnx.use_eager_sharding(False):
    model = tiny_lm.TinyLM(tiny_lm.VOCAB, 8, nnx.Rngs(0))
  inputs, targets = mqar_lib.multiquery_ar(tiny_lm.VOCAB, 4, 16, 2, seed=0)
  batch = {"tokens": inputs, "targets": targets,
           "positions": mqar_lib.target_positions(targets)}
  return model, batch


def test_the_train_and_eval_steps_use_the_objective(calls):
  model, batch = _tiny_parts()
  graphdef, params, model_state = models.split_model(model)
  tx = optax.sgd(1e-2)
  step = steps_lib.train_step_fn(graphdef, tx, optax.constant_schedule(1e-2),
                                 objective_lib.Objective(), grad_accum_steps=2)
  state = {"step": jnp.int32(0), "params": params, "model_state": model_state,
           "opt_state": tx.init(params)}
  _, metrics = jax.jit(step)(state, batch)
  assert calls == {"position_metrics": 1, "minimised": 1}
  assert {"train/loss", "train/accuracy"} <= set(metrics)
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  steps_lib.make_eval_step(graphdef, sharding)(params, model_state, batch)
  assert calls == {"position_metrics": 2, "minimised": 1}


def test_the_batched_steps_use_the_objective(calls):
  group = batched.GroupModel(tiny_lm.tiny_mqar_config(), total_steps=4)
  state = group.init([0, 1], jax.devices()[0])
  _, batch = _tiny_parts()
  stacked = jax.tree.map(lambda x: jnp.stack([x, x]), batch)
  state, _ = group.train_step(state, stacked, jnp.asarray([1e-2, 2e-2]),
                              jnp.asarray([True, True]))
  assert calls == {"position_metrics": 1, "minimised": 1}
  group.eval_step(state["params"], state["model_state"], stacked)
  assert calls == {"position_metrics": 2, "minimised": 1}


def test_the_scorers_use_the_objective(calls):
  model, batch = _tiny_parts()
  result = mqar_eval.accuracy_on(model, batch["tokens"], batch["targets"], batch_size=4)
  assert calls["position_metrics"] == 1 and result["num_queries"] == 8
  tokens = np.asarray(batch["tokens"])
  log_probs, greedy = lm_eval.ModelScorer(model)(tokens, np.zeros_like(tokens),
                                                 np.roll(tokens, -1, axis=1))
  assert calls == {"position_metrics": 2, "minimised": 0}
  assert log_probs.shape == greedy.shape == tokens.shape and greedy.dtype == bool
  assert np.all(log_probs <= 0)
