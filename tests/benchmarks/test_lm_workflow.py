"""benchmarks/lm_workflow.py: the kill after a checkpoint (fast) and the whole CPU check (slow)."""

import json
import sys

import pytest

from benchmarks import lm_workflow

# Logs steps 1..9, a checkpoint folder appearing after step 3, then hangs.
_FAKE_TRAIN = """
import os, sys, time
for step in range(1, 10):
  print(f"step {step}/9 | ...", flush=True)
  time.sleep(0.3)
  if step == 3:
    os.makedirs(os.path.join(sys.argv[1], "3"))
time.sleep(60)
"""


def test_killed_at_the_first_step_after_a_checkpoint(tmp_path):
  checkpoints = tmp_path / "checkpoints"
  (checkpoints / "2.orbax-checkpoint-tmp-1").mkdir(parents=True)  # Not a complete checkpoint.
  result = lm_workflow.run_until_killed(
      [sys.executable, "-c", _FAKE_TRAIN, str(checkpoints)], tmp_path / "log", checkpoints,
      kill_after_step=2, timeout=30)
  assert result["killed_at_step"] == 4 and result["wall_s"] < 30
  assert "step 4/9" in (tmp_path / "log").read_text()


def test_silent_run_is_killed_at_the_timeout(tmp_path):
  result = lm_workflow.run_until_killed(
      [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "log",
      tmp_path / "checkpoints", kill_after_step=1, timeout=1)
  assert result["killed_at_step"] is None and result["wall_s"] < 30


def test_startup_reads_the_last_start_up_record():
  records = [{"step": 1, "perf/compile_s": 9.0, "perf/lower_s": 1.0,
              "perf/compile_cache_hits": 0, "perf/time_to_first_step_s": 20.0},
             {"step": 2, "train/loss": 3.0},
             {"step": 1, "perf/compile_s": 1.0, "perf/lower_s": 1.0,
              "perf/compile_cache_hits": 2, "perf/time_to_first_step_s": 5.0}]
  assert lm_workflow.startup(records) == {"compile_s": 1.0, "lower_s": 1.0,
                                          "compile_cache_hits": 2,
                                          "time_to_first_step_s": 5.0}
  assert lm_workflow.startup(records[1:2]) == {}


@pytest.mark.slow
def test_cpu_check_end_to_end(tmp_path):
  """The docstring's CPU check: a tiny Palimpsa-D killed, resumed and benchmarked (minutes)."""
  result = lm_workflow.main([
      "--output_dir", str(tmp_path / "out"), "--work_dir", str(tmp_path / "work"),
      "--size", "tiny", "--seq_len", "64", "--batch", "2", "--steps", "12",
      "--kill_after_step", "6", "--checkpoint_every", "4", "--eval_every", "4",
      "--log_every", "2", "--corpus_mb", "1.5", "--no_record"])
  assert result["cold"]["killed_at_step"] >= 6 and result["warm"]["resumed"]
  assert result["warm"]["max_loss_difference"] == 0.0
  assert result["compile_speedup"] >= 2 and result["benchmark_tokens_per_s"] > 0
  assert json.loads((tmp_path / "out" / "lm_workflow.json").read_text())["warm"]["summary"]
