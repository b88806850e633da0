"""eval.py's MQAR suite and the trainer's evaluation agree on one checkpoint and one test set."""

import importlib.util
import json
import pathlib

import pytest

from palimpsa_jax.evaluation import mqar as mqar_eval
from palimpsa_jax.evaluation.suites import SUITES
from palimpsa_jax.training import trainer

REPO = pathlib.Path(__file__).parents[2]
NUM_TEST_EXAMPLES = 40


def _mqar_config(arg: str):
  spec = importlib.util.spec_from_file_location("mqar_config", REPO / "configs" / "mqar.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def test_the_suite_scores_the_trainers_test_set_as_the_trainer_did(tmp_path, monkeypatch):
  """A few steps of the real Palimpsa-D; then eval.py's suite on the run's own test set (its
  seed stream moved onto the trainer's, 2 * seed + 1), in batches of another size, from a
  config.json that also holds the head_loss fields earlier versions wrote."""
  config = _mqar_config(
      "seq_len=16,num_kv_pairs=2,vocab_size=32,d_model=16,num_heads=2,head_v_dim=8,"
      f"num_train_examples=256,num_test_examples={NUM_TEST_EXAMPLES},batch_size=16,"
      "total_steps=40,evals_per_epoch=1,learning_rate=1e-2,early_stop_accuracy=none")
  config.async_checkpointing = False
  config.log_diagnostics = False
  workdir = tmp_path / "run"
  summary = trainer.train_and_evaluate(config, str(workdir))
  trained = summary["last_eval"]
  assert summary["final_step"] == 40 and 0 < trained["eval/accuracy"] < 1

  saved = json.loads((workdir / "config.json").read_text())
  saved["args"]["head_loss"] = saved["model"]["head_loss"] = "pallas_gpu"
  (workdir / "config.json").write_text(json.dumps(saved))
  monkeypatch.setattr(mqar_eval, "_TEST_SEED_OFFSET", 2 * config.seed + 1)
  result = SUITES["mqar"]({"checkpoint": [str(workdir)], "num_examples": NUM_TEST_EXAMPLES,
                           "batch_size": 16})
  (evaluation,) = result["evaluations"]
  (scored,) = evaluation["results"]
  assert evaluation["step"] == 40 and scored["trained_setting"]
  assert scored["num_queries"] == NUM_TEST_EXAMPLES * 2
  assert scored["accuracy"] == trained["eval/accuracy"]
  assert scored["loss"] == pytest.approx(trained["eval/loss"], rel=1e-5)
