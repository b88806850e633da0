"""Command-line configs: bad `--config.<field>` overrides, and fields derived from the run's length."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

from palimpsa_jax.training import config_overrides
from palimpsa_jax.training import optimizer as optimizer_lib

REPO = pathlib.Path(__file__).parents[2]


def _config_module(name):
  spec = importlib.util.spec_from_file_location(f"{name}_config", REPO / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _dry_run(*overrides):
  return subprocess.run(
      [sys.executable, "train.py", "--config=configs/mqar.py:num_kv_pairs=8", *overrides,
       "--dry_run"],
      cwd=REPO, capture_output=True, text=True, timeout=300)


def test_misspelled_fields_get_one_line_with_the_nearest_names():
  result = _dry_run("--config.optimizer.learning_rat=1e-3")
  assert result.returncode != 0
  assert result.stderr.strip() == (
      "train.py: --config.optimizer.learning_rat: no such config field; nearest: "
      "--config.optimizer.learning_rate.")
  result = _dry_run("--config.learning_rat=1")
  assert result.returncode != 0
  assert result.stderr.strip() == (
      "train.py: --config.learning_rat: no such config field; nearest: "
      "--config.optimizer.learning_rate.")


def test_an_earlier_spelling_names_the_new_one_in_one_line():
  result = _dry_run("--config.lr=1")
  assert result.returncode != 0
  assert result.stderr.strip() == (
      "train.py: --config.lr: no such config field; lr is now called learning_rate: "
      "--config.optimizer.learning_rate.")
  result = subprocess.run(
      [sys.executable, "train.py", "--config=configs/mqar.py:kv=8,lr=1e-3", "--dry_run"],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode != 0
  assert result.stderr.strip() == (
      "train.py: --config=configs/mqar.py:kv=8,lr=1e-3: config argument kv is now called num_kv_pairs "
      "(e.g. num_kv_pairs=<value>).")


def test_wrong_type_is_one_line():
  result = _dry_run("--config.optimizer.learning_rate=abc")
  assert (result.returncode, result.stderr) == (
      1, "train.py: --config.optimizer.learning_rate=abc: expected a number\n")


def test_overriding_a_config_argument_is_refused_with_the_working_form():
  result = _dry_run("--config.args.lr=0.5")  # under an earlier name too
  assert result.returncode != 0
  assert result.stderr.startswith("train.py: --config.args.lr would not change the run")
  assert result.stderr.strip().endswith(
      "Give it as a config argument instead: "
      "--config=configs/mqar.py:num_kv_pairs=8,learning_rate=0.5")


def test_unknown_field_messages():
  config = _config_module("mqar").get_config()
  message = config_overrides.unknown_field_message
  assert message(config, "optimizer.learning_rate") is None
  assert message(config, "data.num_kv_pair").endswith("nearest: --config.data.num_kv_pairs.")
  assert message(config, "learning_rate").endswith(
      "nearest: --config.optimizer.learning_rate.")
  assert "config.data.vocab_size is a value of type int" in message(config, "data.vocab_size.x")
  assert message(config, "optimizer.zzz").endswith(
      "the fields of config.optimizer are b1, b2, clip_norm, decay_steps, end_fraction, eps, "
      "learning_rate, new_params_only_steps, warmup_fraction, weight_decay.")


def test_overrides_and_config_argument_from_argv():
  argv = ["train.py", "--config", "configs/lm.py:size=tiny", "--config.seed=3",
          "--noconfig.log_diagnostics", "--workdir=x"]
  assert config_overrides.overrides(argv) == {"seed": "3", "log_diagnostics": None}
  assert config_overrides.config_argument(argv) == "configs/lm.py:size=tiny"


def _warmup(config, total_steps):
  """Steps until the learning rate reaches its peak."""
  schedule = optimizer_lib.learning_rate_schedule(config.optimizer, total_steps)
  peak = config.optimizer.learning_rate
  return next(s for s in range(total_steps + 1) if float(schedule(s)) == pytest.approx(peak))


def test_mqar_steps_argument():
  assert _warmup(_config_module("mqar").get_config(), 2500) == 125  # 5% of 4 epochs
  config = _config_module("mqar").get_config("total_steps=200")
  assert config.total_steps == 200
  assert _warmup(config, 200) == 10  # 5% of the run
  with pytest.raises(ValueError, match=r"total_steps=-1 must be a positive int, or None"):
    _config_module("mqar").get_config("total_steps=-1")


@pytest.mark.parametrize("name, arg, warmup_of_200", [
    ("mqar", "", 10),                      # 5% of the steps (the full run: 125 of 2500)
    ("lm", "size=tiny", 20),               # 200 of 2000 steps: 10%
    ("lm", "size=170m", 14),               # 2000 of 28611 steps
])
def test_warmup_follows_a_total_steps_override(name, arg, warmup_of_200):
  config = _config_module(name).get_config(arg)
  config.total_steps = 200  # as --config.total_steps=200 does
  assert _warmup(config, 200) == warmup_of_200
