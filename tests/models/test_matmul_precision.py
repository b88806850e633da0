"""MQAR's opt-in matmul precision reaches the jitted train step; the op keeps its own."""

import importlib.util
import pathlib

from flax import nnx
import jax
import jax.extend
import jax.numpy as jnp
import optax
import pytest

from palimpsa_jax import models
from palimpsa_jax.data import mqar
from palimpsa_jax.ops.palimpsa import api as palimpsa_api
from palimpsa_jax.run_config import base
from palimpsa_jax.training import objective as objective_lib
from palimpsa_jax.training import steps as steps_lib

REPO = pathlib.Path(__file__).resolve().parents[2]


def _mqar_config(arg: str):
  spec = importlib.util.spec_from_file_location("mqar_config", REPO / "configs" / "mqar.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def _dot_precisions(jaxpr) -> list:
  """The precision of every dot_general in a closed jaxpr, sub-jaxprs included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      found.append(eqn.params["precision"])
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found.extend(_dot_precisions(sub))
  return found


def _step_dots(matmul: str) -> list:
  config = _mqar_config(f"seq_len=16,num_kv_pairs=2,vocab_size=32,d_model=32,num_heads=2,"
                        f"matmul_precision={matmul}")
  graphdef, params, model_state = models.split_model(
      models.build_model(config.model, nnx.Rngs(0)))
  tx = optax.sgd(1e-2)
  step = steps_lib.train_step_fn(graphdef, tx, optax.constant_schedule(1e-2),
                                 objective_lib.Objective())
  tokens, targets = mqar.multiquery_ar(32, 2, 16, 2, seed=0)
  state = {"step": jnp.int32(0), "params": params, "model_state": model_state,
           "opt_state": tx.init(params)}
  return _dot_precisions(jax.make_jaxpr(jax.jit(step))(
      state, {"tokens": tokens, "targets": targets}).jaxpr)


def test_bfloat16_products_reach_the_step_and_spare_the_op():
  default = _step_dots("default")
  chosen = _step_dots("bfloat16")
  preset = jax.lax.DotAlgorithmPreset.BF16_BF16_F32
  assert len(chosen) == len(default)
  assert preset not in default
  # Every matmul that names no precision takes the preset, the gradients' included
  # (the projections, the head's loss forward and backward)...
  renamed = [(d, c) for d, c in zip(default, chosen) if d != c]
  assert len(renamed) >= 12 and all(d is None and c == preset for d, c in renamed)
  # ...and those that name one (the op's chunked float32 sums here) keep it.
  assert [c for d, c in zip(default, chosen) if d is not None] == [
      d for d in default if d is not None]


def test_the_op_runs_under_no_default_precision(monkeypatch):
  """The op's kernels choose their own products' precision, whatever the model's."""
  seen = []
  run = palimpsa_api._whole_sequence

  def spy(*args, **kwargs):
    seen.append(jax.config.jax_default_matmul_precision)
    return run(*args, **kwargs)

  monkeypatch.setattr(palimpsa_api, "_whole_sequence", spy)
  config = models.mqar_model_config("palimpsa_d", d_model=32, vocab_size=32,
                                    dtype="float32", matmul_precision="bfloat16")
  model = models.build_model(config, nnx.Rngs(0))
  jax.eval_shape(lambda: model(jnp.zeros((1, 16), jnp.int32)))
  assert seen == [None, None]  # Two layers.


def test_bad_matmul_precision_names_the_argument():
  with pytest.raises(ValueError, match="matmul_precision=tf32 must be one of"):
    _mqar_config("matmul_precision=tf32")
  config = models.mqar_model_config("palimpsa_d", d_model=32, vocab_size=32,
                                    matmul_precision="half")
  with pytest.raises(base.ConfigError, match="config.model.matmul_precision must be one of"):
    models.config.validate(config)
