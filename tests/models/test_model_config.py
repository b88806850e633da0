"""Model configs: parameter budgets, MQAR settings, inits, masks, sharding names."""

import inspect

import chex
import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from palimpsa_jax.layers import params as params_lib
from palimpsa_jax.models import (abstract_parameter_count, build_model,
                                 make_mixer,
                                 model_config, mqar_model_config,
                                 parameter_table, weight_decay_mask)
from palimpsa_jax.models import config as config_lib
from palimpsa_jax.models import registry
from palimpsa_jax.models.config import MODELS, NOMINAL_PARAMS
from palimpsa_jax.run_config import base


@pytest.mark.parametrize("size", ["170m", "760m", "2.7b"])
@pytest.mark.parametrize("model", MODELS)
def test_parameter_count_within_ten_percent_of_size(model, size):
  count = abstract_parameter_count(model_config(model, size), build_model)
  assert abs(count / NOMINAL_PARAMS[size] - 1) < 0.10, count


@pytest.mark.parametrize("size", ["170m", "760m"])
@pytest.mark.parametrize("baseline", ["gated_deltanet", "mesanet", "transformer"])
def test_baselines_match_palimpsa_d_budget(baseline, size):
  ours = abstract_parameter_count(model_config("palimpsa_d", size), build_model)
  theirs = abstract_parameter_count(model_config(baseline, size), build_model)
  assert abs(theirs / ours - 1) < 0.03


def _abstract(config):
  return nnx.eval_shape(lambda: build_model(config, nnx.Rngs(0)))


def test_parameter_table_rows_and_total():
  config = model_config("palimpsa_d", "tiny")
  table, total = parameter_table(_abstract(config))
  lines = table.splitlines()
  names = [line.split()[0] for line in lines[1:-1]]
  assert names == ["blocks.0", "blocks.1", "embed", "final_norm"]
  assert lines[-1].split()[-1] == f"{total:,}"
  assert total == abstract_parameter_count(config, build_model) < 1_000_000


@pytest.mark.parametrize("model", MODELS)
def test_every_parameter_has_logical_axis_names(model):
  state = nnx.state(_abstract(model_config(model, "tiny")), nnx.Param)
  for path, var in nnx.to_flat_state(state):
    names = var.get_metadata().get("out_sharding")
    assert names is not None and len(names) == len(var.shape), path
    assert all(name in params_lib.LOGICAL_AXES for name in names), path
  assert state["embed"].get_metadata()["out_sharding"] == ("vocab", "embed")


@pytest.mark.parametrize("model", ["palimpsa_d", "meta_mamba2", "mesanet", "transformer"])
def test_weight_decay_mask_exclusions(model):
  # With the beta up-projection's bias (not the default), to see that it does not decay.
  bias = {"beta_bias": True} if model in ("palimpsa_d", "meta_mamba2") else {}
  state = nnx.state(_abstract(model_config(model, "tiny", **bias)), nnx.Param)
  flat, _ = jax.tree_util.tree_flatten_with_path(weight_decay_mask(state))
  mask = {tuple(getattr(k, "key", None) for k in path
                if hasattr(k, "key")): decays for path, decays in flat}
  excluded = {"A_log", "dt_bias", "D", "b_scale", "Ip_log", "lam_raw", "bias", "scale"}
  seen = set()
  for path, decays in mask.items():
    seen.add(path[-1])
    if path[-1] in excluded:
      assert decays is False, path
    else:
      assert path[-1] == "embed" or path[-1] == "kernel", path
      assert decays is True, path
  if model == "palimpsa_d":
    assert {"A_log", "dt_bias", "D", "b_scale", "Ip_log", "bias"} <= seen
  if model == "meta_mamba2":
    assert {"A_log", "dt_bias", "D", "b_scale", "Ip_log", "bias"} <= seen
  if model == "mesanet":
    assert {"A_log", "dt_bias", "lam_raw"} <= seen


def test_logical_names_map_to_mesh_axes_and_plain_dict_masks():
  state = nnx.state(_abstract(model_config("palimpsa_d", "tiny")), nnx.Param)
  rules = [("embed", "fsdp"), ("heads", "tensor"), ("vocab", "tensor"),
           ("mlp", "tensor")]
  with flax.linen.logical_axis_rules(rules):
    specs = nnx.get_partition_spec(state)
  assert specs["embed"].get_value() == jax.sharding.PartitionSpec("tensor", "fsdp")
  q_spec = specs["blocks"][0]["mixer"]["q_proj"]["kernel"].get_value()
  assert q_spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  plain = {"blocks": {0: {"mixer": {"A_log": np.zeros(2),
                                    "q_proj": {"kernel": np.zeros((2, 2))}}}}}
  mask = weight_decay_mask(plain)
  assert mask["blocks"][0]["mixer"]["A_log"] is False
  assert mask["blocks"][0]["mixer"]["q_proj"]["kernel"] is True


def test_mqar_settings():
  pd = mqar_model_config("palimpsa_d")
  assert (pd.num_layers, pd.d_model, pd.vocab_size, pd.mlp_hidden_dim) == (
      2, 128, 8192, None)
  assert (pd.num_heads, pd.head_k_dim, pd.head_v_dim, pd.beta_rank) == (
      8, 16, 32, 8)
  mm = mqar_model_config("meta_mamba2")
  assert (mm.expand * mm.d_model // mm.head_dim, mm.head_dim, mm.state_dim,
          mm.num_groups) == (8, 32, 16, 8)
  gdn = mqar_model_config("gated_deltanet")
  assert (gdn.num_heads, gdn.head_k_dim, gdn.head_v_dim) == (8, 16, 32)
  assert not mqar_model_config("transformer").rope
  assert not mqar_model_config("not_palimpsa").metaplasticity
  assert not mqar_model_config("mamba2").metaplasticity
  small = mqar_model_config("mamba2", d_model=64)  # 4 heads of P=32: 4 B/C groups
  assert (small.d_model, small.num_groups) == (64, 4)


@pytest.mark.parametrize("model", ["palimpsa_d", "mamba2", "gated_deltanet", "mesanet"])
def test_mqar_forget_gate_init_is_small(model):
  mixer = make_mixer(mqar_model_config(model), nnx.Rngs(0))
  a = np.exp(np.asarray(mixer.A_log[...]))
  assert a.size == 8
  chex.assert_trees_all_close(a, np.linspace(0.01, 0.16, 8), rtol=1e-5)
  dt = np.asarray(jax.nn.softplus(mixer.dt_bias[...]))
  assert np.all(dt >= 1e-3 * (1 - 1e-5)) and np.all(dt <= 1e-1 * (1 + 1e-5))


def test_default_forget_gate_inits():
  pd = build_model(model_config("palimpsa_d", "tiny", num_heads=16,
                                head_k_dim=4, head_v_dim=4), nnx.Rngs(0))
  a = np.exp(np.asarray(pd.blocks[0].mixer.A_log[...]))
  assert np.all(a > 0) and np.all(a < 16) and np.ptp(a) > 4
  mamba = build_model(model_config("mamba2", "tiny"), nnx.Rngs(0))
  a = np.exp(np.asarray(mamba.blocks[0].mixer.A_log[...]))
  chex.assert_trees_all_close(a, np.arange(1.0, a.size + 1), rtol=1e-6)
  mixer = pd.blocks[0].mixer
  chex.assert_trees_all_equal((mixer.D[...], mixer.b_scale[...], mixer.Ip_log[...]),
                              (1.0, 1.0, 0.0))
  bound = mixer.beta_up.kernel[...].shape[0] ** -0.5
  assert float(jnp.max(jnp.abs(mixer.beta_up.kernel[...]))) <= bound
  assert abs(float(jnp.std(mixer.q_proj.kernel[...])) - 0.02) < 0.004


def test_config_errors():
  with pytest.raises(ValueError, match="model must be one of"):
    model_config("mamba3", "tiny")
  with pytest.raises(ValueError, match="size must be one of"):
    model_config("mamba2", "1b")
  with pytest.raises(ValueError, match="unknown model config field 'heads'"):
    model_config("palimpsa_d", "tiny", heads=3)
  assert model_config("palimpsa_d", "tiny", dtype="float32").dtype == "float32"


def _layers_with_beta(model) -> list[int]:
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  return [i for i, block in sorted(params["blocks"].items())
          if {"beta_down", "beta_up", "b_scale", "Ip_log"} <= set(block["mixer"])]


@pytest.mark.parametrize("model", ["not_palimpsa", "mamba2"])
def test_metaplastic_layers_field_makes_only_those_layers_metaplastic(model):
  assert model_config(model, "tiny").metaplastic_layers == ()
  config = model_config(model, "tiny", num_layers=3, metaplastic_layers=(2, 0))
  lm = _abstract(config)
  assert _layers_with_beta(lm) == [0, 2]
  assert [b.mixer.metaplasticity for b in lm.blocks] == [True, False, True]
  assert _layers_with_beta(_abstract(model_config(model, "tiny"))) == []
  # metaplasticity=True already covers every layer.
  full = model_config(model, "tiny", num_layers=3, metaplasticity=True,
                      metaplastic_layers=(1,))
  assert _layers_with_beta(_abstract(full)) == [0, 1, 2]


def test_metaplastic_layers_errors():
  for layers, match in (((2,), r"indices \[2\] are outside \[0, num_layers=2\)"),
                        ((-1,), "outside"), ((1, 1), "repeats")):
    with pytest.raises(ValueError, match=match):
      build_model(model_config("mamba2", "tiny", metaplastic_layers=layers),
                  nnx.Rngs(0))
  for model in ("gated_deltanet", "transformer"):
    with pytest.raises(ValueError, match="needs a mixer in"):
      build_model(model_config(model, "tiny", metaplastic_layers=(0,)),
                  nnx.Rngs(0))


@pytest.mark.parametrize("model", ["palimpsa_d", "meta_mamba2"])
def test_default_beta_up_projection_has_no_bias_as_the_authors(model):
  state = nnx.state(_abstract(model_config(model, "tiny")), nnx.Param)
  paths = [tuple(getattr(k, "key", None) for k in path)
           for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
  assert any("beta_up" in p for p in paths)
  assert not any("beta_up" in p and p[-1] == "bias" for p in paths)


def test_every_registered_mixer_is_a_model_of_a_known_kind():
  assert MODELS == tuple(registry.MIXERS)
  assert set(registry.PAPER_MQAR) == {
      "palimpsa_d", "not_palimpsa", "meta_mamba2", "mamba2", "gated_deltanet"}
  for name, mixer in registry.MIXERS.items():
    assert mixer.kind in registry.KINDS, name
    assert not mixer.metaplasticity or registry.KINDS[mixer.kind].metaplastic, name


@pytest.mark.parametrize("kind", sorted(registry.KINDS))
def test_a_kinds_fields_are_its_layers_arguments(kind):
  """make_mixer passes every field of a kind to its layer under the argument's name."""
  family = registry.KINDS[kind]
  parameters = set(inspect.signature(family.layer.__init__).parameters)
  if kind == "mesanet":  # MesaNet takes Gated DeltaNet's arguments as **kwargs
    parameters |= set(inspect.signature(registry.GatedDeltaNet.__init__).parameters)
  arguments = {family.renamed.get(f, f) for f in family.fields} | set(family.model_fields)
  renamed_back = {v: k for k, v in family.renamed.items()}
  arguments = {renamed_back.get(a, a) for a in arguments}
  assert arguments <= parameters, arguments - parameters
  assert set(family.sizes) == set(config_lib.SIZES)


@pytest.mark.parametrize("model", MODELS)
def test_every_config_made_here_passes_the_schema(model):
  for size in config_lib.SIZES:
    config_lib.validate(model_config(model, size))
  config_lib.validate(mqar_model_config(model))


@pytest.mark.parametrize("field, value, message", [
    ("mlp_hidden_dim", 0, "config.model.mlp_hidden_dim must be a positive int, or None (no MLP), "
                          "got 0."),
    ("num_heads", None, "config.model.num_heads must be a positive int, got None."),
    ("precision", "rank2",
     "config.model.precision must be one of ('exact', 'rank1'), got 'rank2'."),
    ("heads", 4, "config.model.heads is not a config field"),
])
def test_a_bad_model_field_is_named_when_the_model_is_built(field, value, message):
  config = model_config("palimpsa_d", "tiny")
  with config.unlocked():
    config[field] = value
  with pytest.raises(base.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    build_model(config, nnx.Rngs(0))


def test_a_missing_model_field_is_named():
  config = model_config("mamba2", "tiny")
  del config["state_dim"]
  with pytest.raises(base.ConfigError, match="config.model.state_dim is missing"):
    config_lib.validate(config)
  with pytest.raises(base.ConfigError, match="config.model.mixer must be one of"):
    config_lib.validate(model_config("mamba2", "tiny", mixer="lstm"))


def test_an_earlier_model_config_is_upgraded_to_todays():
  """0 for None, and the fields added since with what their absence meant."""
  today = model_config("palimpsa_d", "tiny", mlp_hidden_dim=None)
  earlier = today.to_dict()
  earlier.update(mlp_hidden_dim=0)
  for added in ("beta_bias", "precision", "metaplastic_layers", "scan_layers"):
    del earlier[added]
  upgraded = config_lib.upgrade(earlier)
  assert upgraded.beta_bias is True  # a config saved without the field had the bias
  assert upgraded.mlp_hidden_dim is None and upgraded.precision == "exact"
  today.beta_bias = True
  assert upgraded.to_dict() == today.to_dict()
  # A field an earlier version wrote and the schema no longer has is dropped.
  assert config_lib.upgrade({**earlier, "removed_field": 1}).to_dict() == today.to_dict()
  mamba = model_config("mamba2", "tiny").to_dict()
  assert config_lib.upgrade({**mamba, "norm_groups": 0}).norm_groups is None
  assert config_lib.upgrade({**mamba, "norm_groups": 2}).norm_groups == 2
