"""The authors' PyTorch checkpoints (palimpsa, meta_mamba2) <-> our conversion destinations."""

import errno
import json
import os

from flax import nnx
import jax
import numpy as np
import pytest

from tests.conversion import authors_fixtures as fx
from tests.conversion import mamba2_fixtures
from palimpsa_jax import models
from palimpsa_jax import user_errors
from palimpsa_jax.conversion import checkpoint as checkpoint_lib
from palimpsa_jax.conversion import torch_layouts
from palimpsa_jax.conversion import torch_checkpoints
from palimpsa_jax.training import storage

pytest.importorskip("safetensors")

CASES = [("palimpsa", True), ("palimpsa", False), ("meta_mamba2", True), ("meta_mamba2", False)]


def _import(tmp_path, cfg, tensors, name="imported"):
  source = fx.write_checkpoint(str(tmp_path / f"{name}_src"), cfg, tensors)
  dest = str(tmp_path / name)
  torch_checkpoints.import_checkpoint(source, dest, verbose=False)
  return dest


def _params(dest):
  model, config, info = checkpoint_lib.load_converted(dest)
  _, params, _ = models.split_model(model)
  return model, config, info, params


@pytest.mark.parametrize("model_type,metaplastic", CASES)
def test_synthetic_authors_checkpoint_matches_float64_reference(tmp_path, model_type, metaplastic):
  cfg = fx.hf_config(model_type, metaplastic)
  tensors = fx.random_tensors(cfg, seed=1)
  model, config, info, _ = _params(_import(tmp_path, cfg, tensors))
  assert info["init"] == "imported" and config.metaplasticity == metaplastic
  config.implementation = "sequential"
  tokens = np.random.default_rng(0).integers(0, fx.VOCAB, (2, 9)).astype(np.int32)
  got = np.asarray(nnx.jit(lambda m, x: m(x))(model, jax.numpy.asarray(tokens)))
  want = fx.reference_logits(cfg, tensors, tokens)
  assert got.shape == (2, 9, fx.VOCAB)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


@pytest.mark.parametrize("model_type,metaplastic", CASES)
def test_export_then_import_is_bitwise(tmp_path, model_type, metaplastic):
  cfg = fx.hf_config(model_type, metaplastic)
  first = _import(tmp_path, cfg, fx.random_tensors(cfg, seed=2), "first")
  exported = str(tmp_path / "exported")
  assert torch_checkpoints.export_checkpoint(first, exported, verbose=False) == model_type
  again = str(tmp_path / "again")
  torch_checkpoints.import_checkpoint(exported, again, verbose=False)
  _, config1, _, params1 = _params(first)
  _, config2, _, params2 = _params(again)
  assert config1.to_dict() == config2.to_dict()
  leaves1 = jax.tree_util.tree_leaves_with_path(params1)
  leaves2 = dict(jax.tree_util.tree_leaves_with_path(params2))
  assert len(leaves1) == len(leaves2)
  for path, leaf in leaves1:
    np.testing.assert_array_equal(np.asarray(leaf), np.asarray(leaves2[path]), err_msg=str(path))


def test_export_writes_every_authors_tensor_with_its_shape(tmp_path):
  cfg = fx.hf_config("meta_mamba2")
  exported = str(tmp_path / "exported")
  torch_checkpoints.export_checkpoint(_import(tmp_path, cfg, fx.random_tensors(cfg)), exported,
                                 verbose=False)
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  with safe_open(os.path.join(exported, "model.safetensors"), "np") as f:
    assert f.metadata() == {"format": "pt"}
    shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
  assert shapes == fx.tensor_shapes(cfg)
  with open(os.path.join(exported, "config.json")) as f:
    written = json.load(f)
  assert "time_step_limit" not in written  # their default (0, inf), which JSON cannot spell
  for key, value in cfg.items():
    if key != "time_step_limit":
      assert written[key] == value, key


def test_published_170m_configs_map_to_our_paper_sizes():
  palimpsa = dict(model_type="palimpsa", beta_step_rank=48, conv_size=4, expand_v=1, head_dim=48,
                  hidden_act="swish", hidden_ratio=4, hidden_size=768, intermediate_size=None,
                  norm_eps=1e-6, num_heads=16, num_hidden_layers=19, tie_word_embeddings=True,
                  use_gate=True, use_short_conv=True, vocab_size=32000)
  ours = torch_layouts.our_config(palimpsa)
  paper = models.model_config("palimpsa_d", "170m")
  for key in ("num_layers", "d_model", "num_heads", "head_k_dim", "head_v_dim", "beta_rank",
              "mlp_hidden_dim", "vocab_size", "norm_eps", "conv_kernel"):
    assert ours[key] == paper[key], key
  mamba = dict(model_type="meta_mamba2", beta_step_rank=48, conv_kernel=4, expand=2, head_dim=96,
               hidden_size=768, n_groups=16, norm_eps=1e-5, num_hidden_layers=30, state_size=48,
               use_bias=False, use_conv_bias=True, vocab_size=32000, metaplasticity=False)
  ours = torch_layouts.our_config(mamba)
  paper = models.model_config("mamba2", "170m")
  assert ours.model == "mamba2" and ours.norm_groups == 1 and not ours.beta_bias
  for key in ("num_layers", "d_model", "expand", "head_dim", "state_dim", "num_groups",
              "beta_rank", "vocab_size", "norm_eps", "conv_kernel"):
    assert ours[key] == paper[key], key


@pytest.mark.parametrize("edit,message", [
    (lambda c, t: c.update(model_type="mamba2"), "model_type 'mamba2' is not one of"),
    (lambda c, t: t.pop("model.layers.1.attn.g_proj.weight"),
     "missing tensors: ['model.layers.1.attn.g_proj.weight']"),
    (lambda c, t: t.update({"model.layers.0.attn.extra": np.zeros(2, np.float32)}),
     "unmapped tensors (no counterpart in our model): ['model.layers.0.attn.extra']"),
    (lambda c, t: t.update({"model.layers.0.attn.q_proj.weight": np.zeros((16, 15), np.float32)}),
     "tensor 'model.layers.0.attn.q_proj.weight' has shape (16, 15), expected (16, 16)"),
    (lambda c, t: t.update({"lm_head.weight": t["lm_head.weight"] + 1}),
     "tensor 'lm_head.weight' differs from the embedding"),
    (lambda c, t: c.update(attn={"layers": [1], "num_heads": 2}), "hybrid attention layers"),
    (lambda c, t: c.update(use_residual=False), "use_residual=false"),
])
def test_import_errors_name_the_problem(tmp_path, edit, message):
  cfg = fx.hf_config("palimpsa")
  tensors = fx.random_tensors(cfg)
  edit(cfg, tensors)
  source = fx.write_checkpoint(str(tmp_path / "src"), cfg, tensors)
  with pytest.raises(ValueError) as error:
    torch_checkpoints.import_checkpoint(source, str(tmp_path / "dest"), verbose=False)
  assert message in str(error.value)
  assert not os.path.exists(tmp_path / "dest")


def test_import_rejects_meta_mamba2_biases(tmp_path):
  cfg = dict(fx.hf_config("meta_mamba2"), use_bias=True)
  source = fx.write_checkpoint(str(tmp_path / "src"), cfg, fx.random_tensors(cfg))
  with pytest.raises(ValueError, match="use_bias=true"):
    torch_checkpoints.import_checkpoint(source, str(tmp_path / "dest"), verbose=False)


def _our_destination(tmp_path, config):
  model = models.build_model(config, nnx.Rngs(0))
  dest = str(tmp_path / "ours")
  checkpoint_lib.write_conversion(dest, model, config, {"init": "paper"})
  return dest


@pytest.mark.parametrize("overrides,message", [
    (dict(), "normalises over 2 groups"),
    (dict(norm_groups=1, beta_bias=True),
     "beta_up/bias has no counterpart in the authors' model (their b_proj has no bias; this "
     "one is not zero: train with config.model.beta_bias=False"),
    (dict(norm_groups=1, beta_bias=False, metaplasticity=False, metaplastic_layers=(1,)),
     "only layers [1] of 3 are metaplastic"),
    (dict(norm_groups=1, beta_bias=False, precision="rank1"),
     "config.precision='rank1' (Fast Palimpsa) has no counterpart"),
])
def test_export_errors_name_what_the_authors_lack(tmp_path, overrides, message):
  config = mamba2_fixtures.tiny_config()
  config.update(dict(model="meta_mamba2", metaplasticity=True))
  for key, value in overrides.items():
    config[key] = value
  with pytest.raises(ValueError) as error:
    torch_checkpoints.export_checkpoint(_our_destination(tmp_path, config), str(tmp_path / "out"),
                                   verbose=False)
  assert message in str(error.value)
  assert not os.path.exists(tmp_path / "out" / "model.safetensors")


def test_export_accepts_a_zero_beta_bias(tmp_path):
  config = models.model_config("palimpsa_d", "tiny", num_layers=1, d_model=16, num_heads=2,
                               head_k_dim=8, head_v_dim=8, beta_rank=2, vocab_size=32,
                               mlp_hidden_dim=32, dtype="float32", beta_bias=True)
  model = models.build_model(config, nnx.Rngs(0))
  bias = model.blocks[0].mixer.beta_up.bias
  bias[...] = jax.numpy.zeros_like(bias[...])
  dest = str(tmp_path / "ours")
  checkpoint_lib.write_conversion(dest, model, config, {"init": "paper"})
  torch_checkpoints.export_checkpoint(dest, str(tmp_path / "out"), verbose=False)
  assert os.path.isfile(tmp_path / "out" / "model.safetensors")


@pytest.mark.slow
def test_imported_model_finetunes_and_exports_from_the_train_py_workdir(tmp_path, capsys):
  """configs/finetune.py trains an imported model in its destination; that workdir exports its
  trained parameters exactly."""
  # pylint: disable=g-import-not-at-top
  import importlib.util
  import pathlib
  from palimpsa_jax.training import checkpoint as train_checkpoint
  from palimpsa_jax.training import trainer
  # pylint: enable=g-import-not-at-top
  cfg = fx.hf_config("palimpsa")
  dest = _import(tmp_path, cfg, fx.random_tensors(cfg, seed=3))
  path = pathlib.Path(__file__).parents[2] / "configs" / "finetune.py"
  spec = importlib.util.spec_from_file_location("finetune_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(f"source={dest},total_steps=2,evals=1,seq_len=16,num_kv_pairs=2,"
                             "vocab_size=32,batch_size=4,num_train_examples=16,"
                             "num_test_examples=8")
  config.eval_batch_size, config.log_diagnostics = 8, False
  workdir = dest  # fine-tuned in place (docs/torch_models.md): the export takes its last step
  assert trainer.train_and_evaluate(config, workdir)["final_step"] == 2
  assert f"initialised parameters from {dest}" in capsys.readouterr().out
  exported = str(tmp_path / "exported")
  torch_checkpoints.export_checkpoint(workdir, exported, verbose=False)
  again = str(tmp_path / "again")
  torch_checkpoints.import_checkpoint(exported, again, verbose=False)
  trained, _, _ = train_checkpoint.load_model(workdir)
  _, trained_params, _ = models.split_model(trained)
  start, back = _params(dest)[3], _params(again)[3]
  jax.tree.map(np.testing.assert_array_equal, trained_params, back)
  assert any(not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(trained_params), jax.tree.leaves(start)))


def test_meta_mamba2_norm_groups_must_divide_the_inner_width():
  config = models.model_config("meta_mamba2", "tiny", norm_groups=3)
  with pytest.raises(ValueError, match="norm_groups 3 must be positive and divide d_inner 128"):
    models.build_model(config, nnx.Rngs(0))


def test_command_line_imports_and_exports(tmp_path):
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  cfg = fx.hf_config("meta_mamba2")
  source = fx.write_checkpoint(str(tmp_path / "src"), cfg, fx.random_tensors(cfg))
  run = lambda *args: subprocess.run(
      [sys.executable, "-m", "palimpsa_jax.conversion.torch_models", *args],
      capture_output=True, text=True, check=False, timeout=300,
      cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
  result = run("import", f"--source={source}", f"--dest={tmp_path / 'ours'}")
  assert result.returncode == 0, result.stderr
  assert "imported the authors' meta_mamba2 model" in result.stdout
  result = run("export", f"--checkpoint={tmp_path / 'ours'}", f"--dest={tmp_path / 'back'}")
  assert result.returncode == 0, result.stderr
  back = torch_checkpoints.hf_mamba2.read_tensors(str(tmp_path / "back"))
  for name, value in fx.random_tensors(cfg).items():
    np.testing.assert_array_equal(back[name], value, err_msg=name)


def test_export_of_a_scanned_model_gives_each_layer_its_slice(tmp_path):
  config = torch_layouts.our_config(fx.hf_config("palimpsa"))
  config.scan_layers = True
  model = models.build_model(config, nnx.Rngs(4))
  dest = str(tmp_path / "scanned")
  checkpoint_lib.write_conversion(dest, model, config, {"init": "paper"})
  torch_checkpoints.export_checkpoint(dest, str(tmp_path / "out"), verbose=False)
  tensors = torch_checkpoints.hf_mamba2.read_tensors(str(tmp_path / "out"))
  stacked = models.split_model(model)[1]["blocks"]
  for layer in range(fx.LAYERS):
    np.testing.assert_array_equal(
        tensors[f"model.layers.{layer}.attn.q_proj.weight"],
        np.asarray(stacked["mixer"]["q_proj"]["kernel"][layer]).T)
    np.testing.assert_array_equal(tensors[f"model.layers.{layer}.attn.Ip_log"],
                                  np.asarray(stacked["mixer"]["Ip_log"][layer]))


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_failed_write_names_its_file_in_one_line(tmp_path, monkeypatch, code):
  """A full disk or a read-only folder while writing a conversion or an export is one line
  (storage.WriteFailed, a UserError) naming the file, not an OSError traceback."""
  config = models.model_config("palimpsa_d", "tiny", num_layers=1, d_model=16, num_heads=2,
                               head_k_dim=8, head_v_dim=8, beta_rank=2, vocab_size=32,
                               mlp_hidden_dim=32, dtype="float32", beta_bias=False)
  dest = _our_destination(tmp_path, config)

  def fails(*args, **kwargs):
    raise OSError(code, os.strerror(code))

  monkeypatch.setattr(torch_checkpoints, "save_file", fails)
  with pytest.raises(storage.WriteFailed) as error:
    torch_checkpoints.export_checkpoint(dest, str(tmp_path / "out"), verbose=False)
  assert str(error.value) == (f"cannot write {tmp_path / 'out' / 'model.safetensors'}: "
                              f"{os.strerror(code)} [{errno.errorcode[code]}]")
  assert isinstance(error.value, user_errors.UserError)
  monkeypatch.setattr(checkpoint_lib.checkpoint_lib, "save_params", fails)
  model = models.build_model(config, nnx.Rngs(0))
  with pytest.raises(storage.WriteFailed, match=f"cannot write {tmp_path / 'second'}: "):
    checkpoint_lib.write_conversion(str(tmp_path / "second"), model, config, {"init": "paper"})
