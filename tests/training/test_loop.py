"""One training loop: train.py's run and the sweep's group both train through loop.train."""

import pathlib
import re

import pytest

from tests.training import tiny_lm
from palimpsa_jax.training import batched
from palimpsa_jax.training import loop
from palimpsa_jax.training import trainer

TRAINING = pathlib.Path(__file__).parents[2] / "palimpsa_jax" / "training"


@pytest.fixture(autouse=True)
def _tiny_model(monkeypatch):
  tiny_lm.use_tiny_model(monkeypatch)


def test_both_entry_points_train_through_the_one_loop(tmp_path, monkeypatch):
  calls = []
  real_train = loop.train

  def spy(engine, runs, *args, **kwargs):
    calls.append((type(engine), [run.workdir for run in runs]))
    return real_train(engine, runs, *args, **kwargs)

  monkeypatch.setattr(loop, "train", spy)
  config = tiny_lm.tiny_mqar_config(total_steps=4)
  summary = trainer.train_and_evaluate(config, str(tmp_path / "single"))
  group = [str(tmp_path / "a"), str(tmp_path / "b")]
  summaries = batched.train_group(
      [tiny_lm.tiny_mqar_config(total_steps=4, **{"optimizer.learning_rate": lr})
       for lr in (1e-2, 3e-2)], group)
  assert calls == [(trainer.SingleRun, [str(tmp_path / "single")]),
                   (batched.GroupEngine, group)]
  assert summary["final_step"] == 4 and [s["final_step"] for s in summaries] == [4, 4]


def test_the_entry_points_leave_stepping_logging_saving_and_stopping_to_the_loop():
  """trainer.py and batched.py only prepare an engine and their runs' books; the cadence,
  the metric and checkpoint writes, evaluations and the ends of runs are loop.py's."""
  calls = (r"Cadence\(", r"\.save\(", r"\.write\(", r"\.add_eval\(", r"\.finish\(",
           r"progress\.", r"\.begin\(")
  for name in ("trainer.py", "batched.py"):
    text = (TRAINING / name).read_text()
    assert not [c for c in calls if re.search(c, text)], name
  text = (TRAINING / "loop.py").read_text()
  assert all(re.search(c, text) for c in calls)
