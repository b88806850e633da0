"""benchmarks/op/fast_palimpsa_error.py on CPU: tiny synthetic shapes and a tiny Palimpsa-D."""

import json

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from benchmarks.op import fast_palimpsa_error
from palimpsa_jax import models
from palimpsa_jax.ops import palimpsa


def test_main_prints_the_table_and_writes_a_record(tmp_path):
  result = fast_palimpsa_error.main(["--chunks", "4", "--shape", "1,12,2,4,3", "--records",
                                     str(tmp_path)])
  errors = {name: e for name, _, e in result["rows"]}
  assert list(errors) == ["random", "beta const V", "beta k^2 const"]
  assert len(errors["random"]) == 7
  assert 1e-3 < errors["random"][0] < 1.0  # beta varies over V: an approximation
  # beta constant over V: the output and all grads but beta's are exact; beta k^2 constant
  # over V and K: the rank-1 form stays exact under any change of beta, so dbeta is too.
  const_v = errors["beta const V"]
  assert max(const_v[:4] + const_v[5:]) < 1e-5 and const_v[4] > 1e-3, const_v
  assert max(errors["beta k^2 const"]) < 1e-5, errors["beta k^2 const"]
  (path,) = tmp_path.glob("fast_palimpsa_error_*.json")
  record = json.loads(path.read_text())
  assert "--shape 1,12,2,4,3" in record["command"] and record["git_ref"]
  assert record["table"]["columns"][:3] == ["inputs", "C", "out"]
  assert len(record["table"]["rows"]) == 3


@pytest.mark.parametrize("precision", ["exact", "rank1"])
def test_capture_records_each_layer_s_op_inputs(monkeypatch, precision):
  config = ml_collections.ConfigDict(dict(
      task="mqar", seq_len=16, model=models.mqar_model_config(
          "palimpsa_d", d_model=16, vocab_size=32, num_heads=2, head_v_dim=8, dtype="float32",
          precision=precision),
      data=dict(vocab_size=32, num_kv_pairs=2, power_a=0.01, random_non_queries=False)))
  model = models.build_model(config.model, nnx.Rngs(0))
  monkeypatch.setattr(fast_palimpsa_error.checkpoint_lib, "load_model",
                      lambda workdir: (model, config, 7))
  layers = fast_palimpsa_error.capture_layer_inputs("unused", batch=3, seed=0)
  assert len(layers) == config.model.num_layers
  x = layers[1]
  assert x["q"].shape == (3, 16, 2, config.model.head_k_dim)
  assert x["v"].shape == (3, 16, 2, 8)
  assert x["prior_precision"].shape == (2,) and np.all(x["beta"] >= 0)
  assert np.all(np.isfinite(palimpsa(*(jnp.asarray(x[n]) for n in
                                       fast_palimpsa_error.INPUT_NAMES)).out))


def test_capture_refuses_other_mixers(monkeypatch):
  config = ml_collections.ConfigDict(dict(model=dict(mixer="gated_deltanet")))
  monkeypatch.setattr(fast_palimpsa_error.checkpoint_lib, "load_model",
                      lambda workdir: (None, config, 0))
  with pytest.raises(ValueError, match="palimpsa_d"):
    fast_palimpsa_error.capture_layer_inputs("somewhere", batch=1, seed=0)


@pytest.mark.parametrize("flags", [["--shape", "1,2,3"], ["--chunks", "0"]])
def test_bad_arguments_exit(flags):
  with pytest.raises(SystemExit):
    fast_palimpsa_error.parse_args(flags)
