"""MQAR evaluation of a saved checkpoint, the suites registry and eval.py."""

import errno
import importlib.util
import json
import os
import pathlib
import shutil

from flax import nnx
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tests.training import tiny_lm
from palimpsa_jax import user_errors
from palimpsa_jax.data import mqar as mqar_lib
from palimpsa_jax.evaluation import mqar as mqar_eval
from palimpsa_jax.evaluation.suites import SUITES
from palimpsa_jax.training import storage
from palimpsa_jax.training import trainer

REPO = pathlib.Path(__file__).parents[2]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  with pytest.MonkeyPatch.context() as patcher:
    tiny_lm.use_tiny_model(patcher)
    path = tmp_path_factory.mktemp("mqar_run")
    config = tiny_lm.tiny_mqar_config(**{"optimizer.learning_rate": 3e-2})
    trainer.train_and_evaluate(config, str(path))
  return path


@pytest.fixture(autouse=True)
def _tiny_model(monkeypatch):
  tiny_lm.use_tiny_model(monkeypatch)


def test_accuracy_on_matches_manual_count():
  with nnx.use_eager_sharding(False):
    model = tiny_lm.TinyLM(tiny_lm.VOCAB, 8, nnx.Rngs(0))
  inputs, targets = mqar_lib.multiquery_ar(tiny_lm.VOCAB, 10, 16, 2, seed=0)
  result = mqar_eval.accuracy_on(model, inputs, targets, batch_size=4)
  predictions = np.asarray(jnp.argmax(model(jnp.asarray(inputs)), -1))
  queries = targets != mqar_lib.IGNORE_INDEX
  assert result["num_queries"] == queries.sum() == 20
  assert result["accuracy"] == pytest.approx((predictions == targets)[queries].mean())


def test_suite_evaluates_saved_checkpoint(workdir, capsys):
  result = SUITES["mqar"]({"checkpoint": [str(workdir)], "num_examples": 64,
                           "batch_size": 32, "mqar_settings": "24:3"})
  (evaluation,) = result["evaluations"]
  assert evaluation["step"] == 32
  settings = [(r["seq_len"], r["num_kv_pairs"], r["trained_setting"])
              for r in evaluation["results"]]
  assert settings == [(16, 2, True), (24, 3, False)]
  trained = evaluation["results"][0]
  assert trained["num_queries"] == 128 and 0 <= trained["accuracy"] <= 1
  assert "accuracy" in capsys.readouterr().out
  # More pairs than the model's vocabulary has keys: refused before any setting is evaluated.
  pairs = tiny_lm.VOCAB // 2
  with pytest.raises(mqar_lib.SettingError,
                     match=rf"^--mqar_settings: {4 * pairs}:{pairs} for .*: vocab_size="):
    SUITES["mqar"]({"checkpoint": [str(workdir)], "mqar_settings": f"{4 * pairs}:{pairs}"})


@pytest.fixture(scope="module")
def eval_main():
  """eval.py as a module, loaded once (its flags can be defined only once)."""
  spec = importlib.util.spec_from_file_location("eval_main", REPO / "eval.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _run_eval(module, *argv: str) -> None:
  """eval.py's main with `argv` as its only flags (an earlier call's are forgotten)."""
  module.flags.FLAGS.unparse_flags()
  module.flags.FLAGS(["eval.py", *argv])
  module.main(["eval.py"])


def test_eval_main_writes_default_json(workdir, eval_main):
  module = eval_main
  _run_eval(module, "--suite=mqar", f"--workdir={workdir}", "--num_examples=32",
            "--batch_size=32")
  saved = json.loads((workdir / "eval_mqar.json").read_text())
  assert saved["suite"] == "mqar" and saved["evaluations"][0]["step"] == 32
  assert module.default_output("mqar", str(workdir / "checkpoints" / "32")) == str(
      workdir / "eval_mqar.json")


def test_results_that_cannot_be_written_are_one_line(workdir, eval_main, tmp_path,
                                                     monkeypatch):
  """A folder that turns read-only (or a disk that fills) during the work: one line naming the
  output, which stays as it was."""
  output = tmp_path / "out.json"
  output.write_text("earlier")
  def read_only(*args, **kwargs):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(output) + ".partial")
  monkeypatch.setattr(storage, "open", read_only, raising=False)
  with pytest.raises(storage.WriteFailed) as failed:
    _run_eval(eval_main, "--suite=mqar", f"--workdir={workdir}", f"--output={output}",
              "--num_examples=32", "--batch_size=32")
  assert user_errors.message(failed.value) == (
      f"cannot write {output}: Read-only file system [EROFS]")
  assert output.read_text() == "earlier"


def test_errors():
  with pytest.raises(mqar_lib.SettingError, match="SEQ_LEN:NUM_KV_PAIRS"):
    mqar_eval.parse_settings("128-16")
  assert mqar_eval.parse_settings("32:8,64:16") == [(32, 8), (64, 16)]
  with pytest.raises(mqar_lib.SettingError) as short:
    mqar_eval.parse_settings("32:8,16:8")
  assert str(short.value) == (
      "--mqar_settings: 16:8: num_kv_pairs=8 needs seq_len >= 4 * num_kv_pairs = 32 (2n "
      "context tokens plus n query slots of 2), got seq_len=16: use num_kv_pairs <= 4 or "
      "seq_len >= 32.")
  with pytest.raises(mqar_lib.SettingError, match="seq_len must be even"):
    mqar_eval.parse_settings([(33, 2)])
  with pytest.raises(ValueError, match="must name at least one checkpoint"):
    mqar_eval.run({})
  with pytest.raises(KeyError, match="unknown suite"):
    SUITES["nope"]  # pylint: disable=pointless-statement
  assert set(SUITES) == {"mqar", "lm", "long_context", "commonsense"}


def test_a_run_of_another_task_is_refused_in_one_line(workdir, tmp_path):
  other = tmp_path / "lm_run"
  shutil.copytree(workdir, other)
  saved = json.loads((other / "config.json").read_text())
  (other / "config.json").write_text(json.dumps({**saved, "task": "lm"}))
  with pytest.raises(user_errors.UserError) as refused:
    mqar_eval.evaluate_checkpoint(str(other), [], 64, 32)
  assert str(refused.value) == (f"checkpoint {other} was trained on task 'lm' (its saved "
                                "config); the mqar suite needs a run of task 'mqar'.")


def test_a_converted_model_is_named_by_its_source_and_metaplastic_layers():
  from palimpsa_jax import models  # pylint: disable=g-import-not-at-top
  trained = ml_collections.ConfigDict({"args": {"model": "mamba2"},
                                       "model": models.mqar_model_config("mamba2")})
  assert mqar_eval.mixer_name(trained) == "mamba2"
  converted = ml_collections.ConfigDict(
      {"model": models.mqar_model_config("mamba2", metaplastic_layers=(1,))})
  assert mqar_eval.mixer_name(converted) == "mamba2+metaplastic[1]"
