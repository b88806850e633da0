"""Layer choice by memory window, zero-init equivalence, paper init, new-parameter training."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.conversion import mamba2_fixtures as fx
from palimpsa_jax import models
from palimpsa_jax.conversion import surgery
from palimpsa_jax.conversion import windows
from palimpsa_jax.conversion.sources import Source
from palimpsa_jax.training import optimizer as optimizer_lib


def _source(model="mamba2", seed=1):
  config = fx.tiny_config(model)
  return Source(fx.random_params(config, seed), config, "test", "memory")


def _model(src):
  graphdef, _, model_state = models.split_model(
      models.build_model(src.config, nnx.Rngs(0)))
  return models.merge_model(graphdef, src.params, model_state)


@pytest.fixture(scope="module")
def tokens():
  return jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 16)), jnp.int32)


def test_head_windows_match_definition():
  a_log, dt = np.log(np.array([0.5, 2.0])), np.array([0.1, 0.01])
  np.testing.assert_allclose(windows.head_windows(a_log, dt),
                             1.0 / (1.0 - np.exp(-np.array([0.05, 0.02]))))


def test_auto_choice_picks_the_weakest_forgetting_layers_and_prints_them():
  src = _source()
  for i, a in enumerate([1.0, 0.01, 0.1]):  # layer 1 forgets least, then 2
    src.params["blocks"][i]["mixer"]["A_log"] = np.full(4, np.log(a), np.float32)
  dt = windows.bias_dt(src.params, 3)
  np.testing.assert_allclose(dt[0], np.logaddexp(src.params["blocks"][0]["mixer"]["dt_bias"], 0))
  w = windows.layer_windows(src.params, dt)
  assert windows.choose_layers(w, 2) == [1, 2]
  assert windows.choose_layers(w, 1, exclude=[1]) == [2]
  table = windows.window_table(w, [1, 2], "softplus(dt_bias)")
  rows = table.splitlines()[2:]
  assert [r.endswith("yes") for r in rows] == [False, True, True]
  with pytest.raises(ValueError, match="more layers"):
    windows.choose_layers(w, 4)


@pytest.mark.parametrize("spec,expected", [
    ("auto:3", windows.LayerChoice(count=3)), ("0,2", windows.LayerChoice(layers=(0, 2))),
    ("none", windows.LayerChoice(layers=()))])
def test_parse_layers(spec, expected):
  assert windows.parse_layers(spec) == expected


@pytest.mark.parametrize("spec", ["auto:0", "auto", "1;2", ""])
def test_parse_layers_errors(spec):
  with pytest.raises(ValueError, match="--layers"):
    windows.parse_layers(spec)


def test_measured_dt_is_softplus_bias_when_the_dt_projection_is_zero(tokens):
  src = _source()
  for i in range(3):
    kernel = np.array(src.params["blocks"][i]["mixer"]["in_proj"]["kernel"])
    kernel[:, -4:] = 0.0  # the dt columns
    src.params["blocks"][i]["mixer"]["in_proj"]["kernel"] = kernel
  measured = windows.measured_dt(_model(src), np.asarray(tokens))
  np.testing.assert_allclose(measured, windows.bias_dt(src.params, 3), rtol=1e-5)
  with pytest.raises(ValueError, match=r"tokens must be \[B, T\]"):
    windows.measured_dt(_model(src), np.zeros(4, np.int32))


@pytest.mark.parametrize("model,layers", [("mamba2", [0, 2]), ("not_palimpsa", [1])])
def test_zero_init_computes_the_source_function(model, layers, tokens):
  src = _source(model)
  expected = np.asarray(_model(src)(tokens))
  converted, config = surgery.convert(src, layers, init="zero", seed=3)
  assert config.metaplastic_layers == tuple(layers)
  for i, block in enumerate(converted.blocks):
    assert block.mixer.metaplasticity == (i in layers)
  np.testing.assert_allclose(np.asarray(converted(tokens)), expected, rtol=1e-5, atol=1e-5)


def test_paper_init_keeps_every_source_weight_and_adds_spec_parameters(tokens):
  src = _source()
  converted, _ = surgery.convert(src, [1], init="paper", seed=3)
  _, params, _ = models.split_model(converted)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b),
               {k: v for k, v in params.items() if k != "blocks"},
               {k: v for k, v in src.params.items() if k != "blocks"})
  mixer = params["blocks"][1]["mixer"]
  for name, value in src.params["blocks"][1]["mixer"].items():
    jax.tree.map(np.testing.assert_array_equal, mixer[name], value)
  np.testing.assert_array_equal(mixer["b_scale"], np.ones(4))
  np.testing.assert_array_equal(mixer["Ip_log"], np.zeros(4))
  bound = 1 / np.sqrt(2)  # beta_rank 2
  assert np.all(np.abs(mixer["beta_up"]["kernel"]) <= bound)
  assert 0.005 < np.std(mixer["beta_down"]["kernel"]) < 0.05
  assert "b_scale" not in params["blocks"][0]["mixer"]
  # beta > 0 now: the function changes, but stays finite.
  logits = np.asarray(converted(tokens))
  assert np.all(np.isfinite(logits))
  assert not np.allclose(logits, np.asarray(_model(src)(tokens)), atol=1e-5)


def test_convert_errors():
  src = _source()
  with pytest.raises(ValueError, match="out of range"):
    surgery.convert(src, [3])
  with pytest.raises(ValueError, match="repeats"):
    surgery.convert(src, [1, 1])
  with pytest.raises(ValueError, match="init must be"):
    surgery.convert(src, [1], init="ones")
  _, config = surgery.convert(src, [1])
  again = Source(src.params, config, "test", "memory")
  with pytest.raises(ValueError, match=r"layers \[1\] are already metaplastic"):
    surgery.convert(again, [1, 2])
  broken = jax.tree.map(lambda x: x, src.params)
  broken["blocks"][0]["mixer"]["D"] = np.ones(5, np.float32)
  with pytest.raises(ValueError, match="blocks/0/mixer/D has shape"):
    surgery.convert(Source(broken, src.config, "test", "memory"), [1])
  del broken["blocks"][0]["mixer"]["D"]
  with pytest.raises(ValueError, match="missing from the source"):
    surgery.convert(Source(broken, src.config, "test", "memory"), [1])


def test_new_parameters_train_first_then_everything():
  converted, _ = surgery.convert(_source(), [1], seed=3)
  _, params, _ = models.split_model(converted)
  mask = models.new_parameter_mask(params)
  assert mask["blocks"][1]["mixer"]["beta_up"]["kernel"]
  assert not mask["blocks"][1]["mixer"]["in_proj"]["kernel"] and not mask["embed"]
  tx = optimizer_lib.train_new_parameters_first(optax.sgd(1.0), mask, steps=2)
  grads = jax.tree.map(jnp.ones_like, params)
  state = tx.init(params)
  for step in range(3):
    updates, state = tx.update(grads, state, params)
    frozen = step < 2
    assert float(jnp.abs(updates["embed"]).max()) == (0.0 if frozen else 1.0)
    assert float(jnp.abs(updates["blocks"][1]["mixer"]["b_scale"]).max()) == 1.0
  assert optimizer_lib.train_new_parameters_first(optax.sgd(1.0), mask, 0) is not None
  with pytest.raises(ValueError, match="steps must be >= 0"):
    optimizer_lib.train_new_parameters_first(optax.sgd(1.0), mask, -1)
