"""The conversion command end to end: sources on disk -> dest -> a fine-tuning start."""

import importlib.util
import json
import pathlib
import re
import shutil
import subprocess
import sys

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conversion import mamba2_fixtures as fx
from palimpsa_jax import models
from palimpsa_jax.conversion import checkpoint as conversion_lib
from palimpsa_jax.conversion import command
from palimpsa_jax.training import checkpoint as checkpoint_lib
from palimpsa_jax.training import trainer

pytest.importorskip("safetensors")

REPO = pathlib.Path(__file__).parents[2]


def _finetune_config(arg):
  spec = importlib.util.spec_from_file_location("finetune_config", REPO / "configs" / "finetune.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def _logits(model, tokens):
  return np.asarray(model(jnp.asarray(tokens)))


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory):
  """A tiny mamba_ssm-layout checkpoint; (folder, config, params)."""
  config = fx.tiny_config()
  params = fx.random_params(config, seed=2)
  folder = str(tmp_path_factory.mktemp("hf") / "mamba2")
  fx.write_hf_checkpoint(folder, fx.to_hf_tensors(params, config, "mamba_ssm"),
                         {"ssm_cfg": {"ngroups": fx.NUM_GROUPS}})
  return folder, config, params


@pytest.fixture(scope="module")
def tokens():
  return np.random.default_rng(1).integers(0, 32, (2, 16)).astype(np.int32)


def test_cli_converts_hf_checkpoint_with_zero_init_to_the_same_function(
    hf_source, tokens, tmp_path):
  folder, config, params = hf_source
  dest = tmp_path / "conv"
  result = subprocess.run(
      [sys.executable, "-m", "palimpsa_jax.conversion", f"--source={folder}",
       f"--dest={dest}", "--layers=auto:2", "--init=zero"],
      capture_output=True, text=True, cwd=REPO, check=False)
  assert result.returncode == 0, result.stderr
  assert "memory window" in result.stdout and "converted layers" in result.stdout
  info = json.loads((dest / "conversion.json").read_text())
  windows = np.asarray(info["windows"]).mean(axis=1)
  assert info["layers"] == sorted(np.argsort(-windows)[:2].tolist())
  assert info["source_kind"] == "mamba_ssm" and info["init"] == "zero"

  model, model_config, _ = conversion_lib.load_converted(str(dest))
  assert list(model_config.metaplastic_layers) == info["layers"]
  graphdef, _, model_state = models.split_model(models.build_model(config, nnx.Rngs(0)))
  source_model = models.merge_model(graphdef, params, model_state)
  np.testing.assert_allclose(_logits(model, tokens), _logits(source_model, tokens),
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(FileExistsError, match="already holds a conversion"):
    command.run_conversion(folder, str(dest), "0", verbose=False)


def test_orbax_not_palimpsa_source_calibration_and_control_copy(tokens, tmp_path):
  config = fx.tiny_config("not_palimpsa")
  params = fx.random_params(config, seed=4)
  workdir = str(tmp_path / "run")
  fx.write_workdir(workdir, config, params)
  info = command.run_conversion(workdir, str(tmp_path / "conv"), "auto:1", "paper", seed=5,
                                calibration_tokens=tokens, verbose=False)
  assert info["source_kind"] == "orbax" and info["source_step"] == 7
  assert info["dt_source"].startswith("calibration batch [2, 16]")
  model, _, _ = conversion_lib.load_converted(str(tmp_path / "conv"))
  _, converted, _ = models.split_model(model)
  layer = info["layers"][0]
  np.testing.assert_array_equal(converted["blocks"][layer]["mixer"]["q_proj"]["kernel"],
                                params["blocks"][layer]["mixer"]["q_proj"]["kernel"])
  np.testing.assert_array_equal(converted["blocks"][layer]["mixer"]["b_scale"], np.ones(2))

  control = command.run_conversion(workdir, str(tmp_path / "control"), "none", verbose=False)
  assert control["layers"] == []
  model, _, _ = conversion_lib.load_converted(str(tmp_path / "control"))
  jax.tree.map(np.testing.assert_array_equal, models.split_model(model)[1], params)

  with pytest.raises(ValueError, match="mixer 'attention'"):
    transformer = models.model_config("transformer", "tiny", num_layers=1, dtype="float32")
    _, t_params, _ = models.split_model(models.build_model(transformer, nnx.Rngs(0)))
    fx.write_workdir(str(tmp_path / "tf"), transformer, t_params)
    command.run_conversion(str(tmp_path / "tf"), str(tmp_path / "tf_conv"), "0", verbose=False)


def test_calibration_batch_from_text_files(tmp_path):
  from palimpsa_jax.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  pytest.importorskip("tokenizers")
  text = tmp_path / "docs.txt"
  text.write_text("\n".join(f"document number {i} says hello" for i in range(40)))
  tokenizer_lib.train_bpe_tokenizer(iter(["hello world document number says"]), 300,
                                    str(tmp_path / "tokenizer.json"))
  batch = command.calibration_batch(str(text), str(tmp_path / "tokenizer.json"), 8, 3)
  assert batch.shape == (3, 8) and batch.dtype == np.int32 and batch.max() < 300
  with pytest.raises(ValueError, match="fewer than"):
    command.calibration_batch(str(text), str(tmp_path / "tokenizer.json"), 1000, 100)
  with pytest.raises(ValueError, match="needs --tokenizer"):
    command.default_tokenizer(str(tmp_path / "other" / "model.safetensors"))


def _new_and_old_leaves(params: dict) -> tuple[dict, dict]:
  """(new metaplastic leaves, source leaves) of a parameter tree, by key path."""
  mask = dict(jax.tree_util.tree_leaves_with_path(models.new_parameter_mask(params)))
  leaves = jax.tree_util.tree_leaves_with_path(params)
  return ({p: np.asarray(x) for p, x in leaves if mask[p]},
          {p: np.asarray(x) for p, x in leaves if not mask[p]})


def test_converted_model_finetunes_through_train_py_and_resumes(
    hf_source, tmp_path, capsys):
  """train.py on configs/finetune.py: converted start, new params first, own resume."""
  folder, _, _ = hf_source
  dest = str(tmp_path / "conv")
  command.run_conversion(folder, dest, "1", "paper", verbose=False)
  arg = (f"source={dest},total_steps=4,new_params_only_steps=2,evals=2,seq_len=16,num_kv_pairs=2,"
         "vocab_size=32,batch_size=8,num_train_examples=64,num_test_examples=16")
  config = _finetune_config(arg)
  assert config.init_from == dest and list(config.model.metaplastic_layers) == [1]
  assert config.total_steps == 4 and config.early_stop_accuracy is None
  assert config.optimizer.learning_rate == 3e-4 and config.data.num_kv_pairs == 2
  workdir = tmp_path / "ft"
  overrides = ["--config.checkpoint_every_steps=2", "--config.eval_batch_size=16",
               "--config.log_diagnostics=False"]
  result = subprocess.run(
      [sys.executable, "train.py", f"--config=configs/finetune.py:{arg}", *overrides,
       f"--workdir={workdir}"],
      capture_output=True, text=True, cwd=REPO, check=False, timeout=300)
  assert result.returncode == 0, result.stderr
  assert f"initialised parameters from {dest}" in result.stdout

  converted, _, _ = conversion_lib.load_converted(dest)
  new_start, old_start = _new_and_old_leaves(models.split_model(converted)[1])
  assert len(new_start) == 4  # beta_down kernel, beta_up kernel (no bias), b_scale, Ip_log
  assert all(p[1].key == 1 for p in new_start)
  model, _, step = checkpoint_lib.load_model(str(workdir / "checkpoints" / "2"))
  new, old = _new_and_old_leaves(models.split_model(model)[1])
  assert step == 2 and old.keys() == old_start.keys()
  for path, value in old.items():  # the source's parameters wait two steps
    np.testing.assert_array_equal(value, old_start[path], err_msg=str(path))
  assert any(not np.array_equal(new[p], new_start[p]) for p in new)
  model, run_config, step = checkpoint_lib.load_model(str(workdir))
  assert step == 4 and list(run_config.model.metaplastic_layers) == [1]
  assert model.blocks[1].mixer.metaplasticity and not model.blocks[0].mixer.metaplasticity
  _, final_old = _new_and_old_leaves(models.split_model(model)[1])
  assert any(not np.array_equal(final_old[p], old_start[p]) for p in old_start)

  # Restarted after step 2, the run continues from its own checkpoint, not init_from.
  shutil.rmtree(workdir / "checkpoints" / "4")
  config.checkpoint_every_steps, config.eval_batch_size = 2, 16
  config.log_diagnostics = False
  capsys.readouterr()
  assert trainer.train_and_evaluate(config, str(workdir))["final_step"] == 4
  out = capsys.readouterr().out
  assert "resumed from" in out and "initialised parameters" not in out
  resumed, _, _ = checkpoint_lib.load_model(str(workdir))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               models.split_model(resumed)[1], models.split_model(model)[1])


def test_finetune_config_errors(hf_source, tmp_path):
  folder, _, _ = hf_source
  dest = str(tmp_path / "conv")
  command.run_conversion(folder, dest, "1", "paper", verbose=False)
  for bad, match in (("total_steps=0", "total_steps=0 must be a positive int"),
                     ("total_steps=20,new_params_only_steps=30", "new_params_only_steps"),
                     ("task=speech", r"task=speech must be one of \('mqar', 'lm'\)")):
    with pytest.raises(ValueError, match=match):
      _finetune_config(f"source={dest},{bad}")
  with pytest.raises(ValueError, match="needs source="):
    _finetune_config("total_steps=5")
  zero = tmp_path / "zero"
  zero.mkdir()
  record = json.loads((tmp_path / "conv" / "conversion.json").read_text())
  (zero / "conversion.json").write_text(json.dumps({**record, "init": "zero"}))
  with pytest.raises(ValueError, match=re.escape(f"source='{zero}' is a --init zero")):
    _finetune_config(f"source={zero}")
