"""Hugging Face Mamba2 safetensors (transformers and mamba_ssm layouts) -> our model."""

import json
import os

from flax import nnx
import jax
import numpy as np
import pytest

from tests.conversion import mamba2_fixtures as fx
from palimpsa_jax import models
from palimpsa_jax.conversion import hf_mamba2

pytest.importorskip("safetensors")

LAYOUTS = ("transformers", "mamba_ssm")


@pytest.fixture(scope="module")
def source():
  config = fx.tiny_config()
  return config, fx.random_params(config, seed=1)


@pytest.fixture(scope="module")
def tokens():
  return np.random.default_rng(0).integers(0, 32, (2, 12)).astype(np.int32)


def _hf_config(layout):
  if layout == "transformers":
    return {"n_groups": fx.NUM_GROUPS, "state_size": fx.STATE_DIM, "layer_norm_epsilon": 1e-5}
  return {"ssm_cfg": {"layer": "Mamba2", "ngroups": fx.NUM_GROUPS, "d_state": fx.STATE_DIM},
          "rms_norm": True}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loaded_model_matches_float64_reference_of_the_checkpoint(
    layout, source, tokens, tmp_path):
  config, params = source
  tensors = fx.to_hf_tensors(params, config, layout)
  folder = fx.write_hf_checkpoint(str(tmp_path / layout), tensors, _hf_config(layout),
                                  shards=2 if layout == "mamba_ssm" else 1)
  loaded, loaded_config, found = hf_mamba2.load_hf_mamba2(folder)
  assert found == layout
  for key in ("num_layers", "d_model", "expand", "head_dim", "state_dim", "num_groups",
              "vocab_size", "conv_kernel"):
    assert loaded_config[key] == config[key], key
  jax.tree.map(np.testing.assert_array_equal, loaded, jax.tree.map(np.asarray, params))

  loaded_config.implementation = "sequential"
  graphdef, _, model_state = models.split_model(
      models.build_model(loaded_config, nnx.Rngs(0)))
  model = models.merge_model(graphdef, jax.tree.map(np.asarray, loaded), model_state)
  ours = np.asarray(model(tokens))
  expected = fx.reference_logits(tensors, layout, tokens, fx.NUM_GROUPS, fx.STATE_DIM)
  np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)


def test_bfloat16_tensors_and_missing_config_json(source, tmp_path):
  config, params = source
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  tensors = fx.to_hf_tensors(params, config, "mamba_ssm", dtype=ml_dtypes.bfloat16)
  folder = fx.write_hf_checkpoint(str(tmp_path / "bf16"), tensors)
  with pytest.raises(ValueError, match="state size|divisible"):
    # G defaults to 1 without config.json: shapes still split, so pass G.
    hf_mamba2.load_hf_mamba2(folder, num_groups=3)
  loaded, loaded_config, _ = hf_mamba2.load_hf_mamba2(folder, num_groups=fx.NUM_GROUPS)
  assert loaded["embed"].dtype == np.float32
  assert loaded_config.state_dim == fx.STATE_DIM
  _, default_config, _ = hf_mamba2.load_hf_mamba2(folder)
  assert default_config.num_groups == 1 and default_config.state_dim == 2 * fx.STATE_DIM


def _tensors(source, layout="transformers"):
  config, params = source
  return fx.to_hf_tensors(params, config, layout)


def _load(tensors, folder, hf_config=None):
  fx.write_hf_checkpoint(folder, tensors, hf_config or _hf_config("transformers"))
  return hf_mamba2.load_hf_mamba2(folder)


def test_unmapped_tensor_is_named(source, tmp_path):
  tensors = _tensors(source)
  tensors["backbone.layers.1.mixer.in_proj.bias"] = np.zeros(3, np.float32)
  tensors["backbone.layers.0.mlp.fc1.weight"] = np.zeros((2, 2), np.float32)
  with pytest.raises(ValueError, match=r"unmapped.*layers\.0\.mlp\.fc1\.weight.*"
                                       r"layers\.1\.mixer\.in_proj\.bias"):
    _load(tensors, str(tmp_path / "extra"))


def test_missing_tensor_is_named(source, tmp_path):
  tensors = _tensors(source)
  del tensors["backbone.layers.2.mixer.dt_bias"]
  del tensors["backbone.norm_f.weight"]
  with pytest.raises(ValueError, match=r"missing tensors.*layers\.2\.mixer\.dt_bias.*norm_f"):
    _load(tensors, str(tmp_path / "missing"))


def test_wrong_shape_untied_head_and_unsupported_options(source, tmp_path):
  tensors = _tensors(source)
  tensors["backbone.layers.1.mixer.D"] = np.ones(32, np.float32)  # D_has_hdim
  with pytest.raises(ValueError, match=r"layers\.1\.mixer\.D.*shape \(32,\)"):
    _load(tensors, str(tmp_path / "dhd"))
  tensors = _tensors(source)
  tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1.0
  with pytest.raises(ValueError, match="lm_head.weight.*untied"):
    _load(tensors, str(tmp_path / "untied"))
  with pytest.raises(ValueError, match="dt limit"):
    _load(_tensors(source), str(tmp_path / "limit"),
          {**_hf_config("transformers"), "time_step_limit": [0.0, 0.1]})
  both = _tensors(source)
  both["backbone.embedding.weight"] = both["backbone.embeddings.weight"]
  with pytest.raises(ValueError, match="layout"):
    _load(both, str(tmp_path / "both"))


def test_not_a_checkpoint(tmp_path):
  os.makedirs(tmp_path / "empty")
  with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
    hf_mamba2.safetensors_files(str(tmp_path / "empty"))
  (tmp_path / "w.bin").write_bytes(b"")
  with pytest.raises(ValueError, match="must be a .safetensors file"):
    hf_mamba2.safetensors_files(str(tmp_path / "w.bin"))
  assert json.dumps(hf_mamba2.read_hf_config(str(tmp_path / "empty"))) == "{}"
