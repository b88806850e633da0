"""train.py and eval.py as a user runs them (subprocesses, real models)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from palimpsa_jax.run_config import config_args

REPO = pathlib.Path(__file__).parents[1]


def _run(*args, check=True):
  return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True,
                        text=True, check=check, timeout=600)


def test_dry_run_prints_parameter_table_and_count():
  import importlib.util  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from palimpsa_jax import models  # pylint: disable=g-import-not-at-top
  out = _run("train.py", "--config=configs/mqar.py:model=mamba2", "--dry_run").stdout
  lines = out.strip().splitlines()
  assert lines[-1].startswith("params: ")
  spec = importlib.util.spec_from_file_location("mqar", REPO / "configs" / "mqar.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("model=mamba2").model
  with nnx.use_eager_sharding(False):
    model = nnx.eval_shape(lambda: models.build_model(config, nnx.Rngs(0)))
  assert int(lines[-1].split()[1]) == models.count_parameters(model)
  assert any("embed" in line for line in lines[:-1])


def test_bad_config_argument_fails_clearly():
  result = _run("train.py", "--config=configs/mqar.py:num_kv_pairs=abc", "--dry_run", check=False)
  assert result.returncode == 1 and result.stderr.strip() == (
      "train.py: --config=configs/mqar.py:num_kv_pairs=abc: config argument "
      "num_kv_pairs='abc' must be an int.")
  result = _run("train.py", "--config=configs/mqar.py:model=lstm", "--dry_run", check=False)
  assert result.returncode == 1 and "config argument model=lstm must be one of" in result.stderr
  assert "Traceback" not in result.stderr
  result = _run("train.py", "--config=configs/mqar.py:mixer=mamba2", "--dry_run", check=False)
  assert result.returncode == 1 and result.stderr.strip() == (
      "train.py: --config=configs/mqar.py:mixer=mamba2: config argument mixer is now called "
      "model (e.g. model=<value>).")


@pytest.mark.parametrize("args, expected", [
    (("--config=configs/mqar.py", "--config.optimizer.b2=1.5"),
     "train.py: config.optimizer.b2 must be a number in [0, 1), got 1.5."),
    # Refused when the model is traced (the op checks its implementation name).
    (("--config=configs/mqar.py:implementation=foo",),
     "train.py: config.model cannot be built and run: implementation must be one of ("),
])
def test_refused_config_field_is_one_line(tmp_path, args, expected):
  result = _run("train.py", *args, f"--workdir={tmp_path / 'run'}", "--compilation_cache_dir=",
                check=False)
  assert result.returncode == 1 and result.stderr.startswith(expected), result.stderr
  assert len(result.stderr.strip().splitlines()) == 1, result.stderr
  assert not (tmp_path / "run").exists()  # Refused before anything is written.


@pytest.mark.parametrize("arg, lr, steps, batch", [
    ("size=170m", 3e-3, 28_611, 128),             # docs/models.md, sizes and recipe: 15B tokens
    ("size=760m", 1.25e-3, 57_221, 128),          # 30B tokens, 0.5M per step
    ("size=760m,batch_size=256", 1.25e-3, 28_611, 256),  # same token budget
    ("size=760m,learning_rate=1e-3,total_steps=10", 1e-3, 10, 128),  # explicit arguments win
])
def test_lm_config_size_defaults(arg, lr, steps, batch):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("lm", REPO / "configs" / "lm.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(arg)
  assert config.optimizer.learning_rate == lr and config.total_steps == steps
  assert config.batch_size == batch and config.seq_len == 4096
  assert config.grad_accum_steps is None and config.device_batch > 0


def test_train_then_eval_palimpsa_d(tmp_path):
  """A few steps of the real Palimpsa-D through train.py, then eval.py on it."""
  workdir = tmp_path / "run"
  out = _run(
      "train.py",
      "--config=configs/mqar.py:seq_len=16,num_kv_pairs=2,vocab_size=32,d_model=16,num_heads=2,"
      "head_v_dim=8,num_train_examples=64,num_test_examples=32,batch_size=16,num_epochs=2,"
      "evals_per_epoch=1",
      "--config.eval_batch_size=32", f"--workdir={workdir}",
      f"--compilation_cache_dir={tmp_path / 'cache'}").stdout
  assert "steps/s" in out and "first step after" in out
  assert any((tmp_path / "cache").iterdir())  # The compiled steps are cached there.
  assert out.strip().splitlines()[-1].startswith("final: best eval accuracy")
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
  assert records[-1]["step"] == 8 and "eval/accuracy" in records[-1]
  assert 0 <= records[-1]["diag/layer0/metaplastic_fraction"] <= 1
  # eval.py reads a config.json of an earlier version, whose arguments had other names.
  saved = json.loads((workdir / "config.json").read_text())
  old_names = {new: old for old, new in config_args.RENAMED_FRACTION.items()}
  saved["args"] = {old_names.get(k, k): v for k, v in saved["args"].items()}
  assert {"kv", "lr", "impl"} <= set(saved["args"])
  (workdir / "config.json").write_text(json.dumps(saved))
  out = _run("eval.py", "--suite=mqar", f"--workdir={workdir}", "--num_examples=32",
             "--mqar_settings=32:4", "--compilation_cache_dir=").stdout
  assert "accuracy" in out
  saved = json.loads((workdir / "eval_mqar.json").read_text())
  results = saved["evaluations"][0]["results"]
  assert [(r["seq_len"], r["num_kv_pairs"]) for r in results] == [(16, 2), (32, 4)]


def test_cpu_lm_preset_trains_on_the_repository_docs_and_its_model_exports(tmp_path,
                                                                            monkeypatch):
  """configs/lm.py:preset=cpu (docs/training.md's first LM run), shortened to 4 steps; a
  model trained with the defaults exports to the authors' PyTorch format."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  from palimpsa_jax.conversion import torch_checkpoints  # pylint: disable=g-import-not-at-top
  from palimpsa_jax.training import trainer  # pylint: disable=g-import-not-at-top
  monkeypatch.chdir(REPO)  # the preset's files are relative to the repository
  spec = importlib.util.spec_from_file_location("lm", REPO / "configs" / "lm.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("preset=cpu,total_steps=4")
  assert (config.model.model, config.model.size, config.seq_len, config.batch_size) == (
      "palimpsa_d", "tiny", 128, 8)
  assert (config.data.train_files, config.data.eval_files) == ("docs/*.md", "README.md")
  config.eval_every_steps = config.checkpoint_every_steps = 4
  config.async_checkpointing = False
  workdir = tmp_path / "run"
  summary = trainer.train_and_evaluate(config, str(workdir))
  assert summary["final_step"] == 4 and summary["last_eval"]["eval/loss"] > 0
  torch_checkpoints.export_checkpoint(str(workdir), str(tmp_path / "hf"), verbose=False)
  assert (tmp_path / "hf" / "model.safetensors").is_file()


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))


_SIGINT_CONFIG = ("--config=configs/mqar.py:seq_len=16,num_kv_pairs=2,vocab_size=32,d_model=16,"
                  "num_heads=2,head_v_dim=8,num_train_examples=512,num_test_examples=64,"
                  "batch_size=16,total_steps=150,early_stop_accuracy=none")


def _losses(workdir):
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


@pytest.mark.slow  # three train.py runs of a real model (about a minute on two cores)
def test_ctrl_c_checkpoints_and_the_rerun_continues_exactly(tmp_path):
  import signal  # pylint: disable=g-import-not-at-top
  cache = f"--compilation_cache_dir={tmp_path / 'cache'}"
  whole, stopped = tmp_path / "whole", tmp_path / "stopped"
  _run("train.py", _SIGINT_CONFIG, f"--workdir={whole}", cache)
  process = subprocess.Popen(
      [sys.executable, "train.py", _SIGINT_CONFIG, f"--workdir={stopped}", cache], cwd=REPO,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  for line in process.stdout:  # mid-run: after the first progress line
    if line.startswith("step "):
      break
  process.send_signal(signal.SIGINT)
  _, err = process.communicate(timeout=300)
  assert process.returncode == 130, err
  last = err.strip().splitlines()[-1]
  step = int(last.split()[3].rstrip(";"))
  assert 0 < step < 150
  assert last == (f"interrupted at step {step}; checkpoint saved in {stopped}/checkpoints/"
                  f"{step}; rerun the same command to resume")
  assert "Traceback" not in err
  resumed = _run("train.py", _SIGINT_CONFIG, f"--workdir={stopped}", cache).stdout
  assert f"resumed from {stopped}/checkpoints/{step}" in resumed
  assert _losses(stopped) == pytest.approx(_losses(whole), rel=1e-6)


@pytest.mark.parametrize("args, expected", [
    (("train.py", "--config=configs/nope.py", "--workdir=WORK"),
     "train.py: --config=configs/nope.py: no config file configs/nope.py"),
    (("train.py", "--config=configs/mqar.py", "--workdir=FILE"),
     "train.py: --workdir=FILE: FILE is a file, not a directory"),
    (("eval.py", "--suite=mqar", "--workdir=WORK"),
     "eval.py: checkpoint='WORK' is neither a workdir written by train.py (holding "
     "config.json) nor one of its checkpoints/<step> folders."),
    (("generate.py", "--checkpoint=WORK", "--prompt=hi"),
     "generate.py: checkpoint='WORK' is neither a workdir written by train.py (holding "
     "config.json) nor one of its checkpoints/<step> folders."),
    (("-m", "palimpsa_jax.data.prepare", "--files=EMPTY", "--tokenizer=bpe:300",
      "--output=WORK/tokens"),
     "prepare: --files='EMPTY': the 1 matched file(s) hold no text (every document is "
     "empty)."),
    # Flag errors caught by absl, config files and the code, each with its command's name.
    (("train.py", "--config=configs/mqar.py", "--config.optimizer.learning_rate=abc",
      "--workdir=WORK"),
     "train.py: --config.optimizer.learning_rate=abc: expected a number"),
    (("train.py", "--config=configs/mqar.py:num_kv_pairs=20", "--workdir=WORK"),
     "train.py: --config=configs/mqar.py:num_kv_pairs=20: num_kv_pairs=20 needs seq_len >= "
     "4 * num_kv_pairs = 80 (2n context tokens plus n query slots of 2), got seq_len=32: "
     "use num_kv_pairs <= 8 or seq_len >= 80."),
    (("train.py", "--config=configs/mqar.py", "--workdir=WORK", "--wokdir=x"),
     "train.py: unknown flag --wokdir (did you mean --workdir?)"),
    (("train.py", "--config=configs/lm.py:preset=cpu", "--config.data.train_files=BYTE",
      "--workdir=WORK"),
     "train.py: config.data.train_files='BYTE' holds 2 tokens, fewer than one batch needs "
     "(8 rows of seq_len 128 = 1024 tokens); give more text or a smaller batch_size or "
     "seq_len."),
    (("eval.py", "--workdir=WORK"), "eval.py: --suite is required (--help lists the flags)"),
    (("eval.py", "--suite=mqar", "--workdir=WORK", "--mqar_settings=abc"),
     "eval.py: --mqar_settings: 'abc' must look like SEQ_LEN:NUM_KV_PAIRS, e.g. 1024:256."),
    (("generate.py", "--checkpoint=WORK/nothing", "--prompt=hi"),
     "generate.py: checkpoint='WORK/nothing' does not exist."),
    (("generate.py", "--checkpoint=WORK", "--prompt_file=LATIN1"),
     "generate.py: LATIN1: byte 3 (0xe9) is not UTF-8 (invalid continuation byte); text "
     "files must be UTF-8."),
    (("-m", "palimpsa_jax.data.prepare", "--files=LATIN1", "--tokenizer=bpe:300",
      "--output=WORK/tokens"),
     "prepare: LATIN1: byte 3 (0xe9) is not UTF-8 (invalid continuation byte); text files "
     "must be UTF-8."),
    (("-m", "palimpsa_jax.data.prepare", "--files=EMPTY"),
     "prepare: the following arguments are required: --tokenizer, --output (--help lists "
     "the arguments)"),
])
def test_ordinary_mistakes_are_one_line(tmp_path, args, expected):
  (tmp_path / "work").mkdir()
  (tmp_path / "file").write_text("")
  (tmp_path / "empty.txt").write_text("")
  (tmp_path / "latin1.txt").write_bytes("caf\u00e9\n".encode("latin-1"))
  (tmp_path / "byte.txt").write_text("x")
  names = {"WORK": str(tmp_path / "work"), "FILE": str(tmp_path / "file"),
           "EMPTY": str(tmp_path / "empty.txt"), "LATIN1": str(tmp_path / "latin1.txt"),
           "BYTE": str(tmp_path / "byte.txt")}
  def fill(text):
    for key, value in names.items():
      text = text.replace(key, value)
    return text
  result = _run(*(fill(a) for a in args), check=False)
  assert (result.returncode, result.stderr) == (1, fill(expected) + "\n")
  assert os.listdir(tmp_path / "work") == []


@pytest.mark.parametrize("command", [("train.py",), ("-m", "palimpsa_jax.conversion"),
                                     ("-m", "palimpsa_jax.conversion.torch_models")])
def test_help_exits_0_and_keeps_the_examples_lines(command):
  result = _run(*command, "--help", check=False)
  assert result.returncode == 0, result.stderr
  assert "\\\n" in result.stdout and "\\ " not in result.stdout


@pytest.mark.parametrize("program, flag", [("train.py", "--workdir"), ("eval.py", "--suite"),
                                           ("generate.py", "--prompt_file")])
def test_dash_h_shows_the_help_and_exits_0(program, flag):
  result = _run(program, "-h", check=False)
  assert (result.returncode, result.stderr) == (0, "")
  assert f"  {flag}:" in result.stdout and "  --[no]verbose:" in result.stdout
