"""The cadence both training loops follow: what is due after a step, and a stop request."""

import time

import ml_collections
import pytest

from palimpsa_jax.training import bookkeeping
from palimpsa_jax.training import cadence as cadence_lib


def _config():
  return ml_collections.ConfigDict(
      {"log_every_steps": 2, "eval_every_steps": 3, "checkpoint_every_steps": 4})


def test_log_eval_and_save_are_due_at_their_intervals_and_the_last_step():
  cadence = cadence_lib.Cadence(_config(), 7, 0, time.time(), lambda: False,
                                lambda step: "")
  due = {step: cadence.after_step(step, overdue=False) for step in range(1, 8)}
  assert [s for s, d in due.items() if d.log] == [2, 4, 6, 7]
  assert [s for s, d in due.items() if d.evaluate] == [3, 6, 7]
  assert [s for s, d in due.items() if d.save] == [4, 7]
  assert [s for s, d in due.items() if d.last] == [7]
  assert cadence.after_step(5, overdue=True).save  # the checkpoint clock ran out


def test_a_stop_request_saves_through_the_loop_then_raises_interrupted():
  saved = []
  requests = iter([False, True])
  cadence = cadence_lib.Cadence(_config(), 7, 0, time.time(), lambda: next(requests),
                                lambda step: saved.append(step) or f"checkpoints/{step}")
  assert cadence.before_step(0, time_due=True)  # overdue, no stop yet
  with pytest.raises(bookkeeping.Interrupted, match="interrupted at step 1; checkpoint saved "
                     "in checkpoints/1; rerun"):
    cadence.before_step(1, time_due=False)
  assert saved == [1]


def test_an_evaluation_shows_on_the_progress_line(capsys):
  cadence = cadence_lib.Cadence(_config(), 7, 0, time.time(), lambda: False,
                                lambda step: "", {"eval/accuracy": 0.5})
  cadence.evaluated(3, {"eval/loss": 0.25, "eval/accuracy": 0.75})
  cadence.progress.show(4, 1.0, 1.0)
  assert capsys.readouterr().out.rstrip().endswith("last eval loss 0.2500 acc 75.00%")
