"""The terminal lines of training: progress, start-up and the final summary's details."""

import time

import pytest

from palimpsa_jax.training import compile_cache
from palimpsa_jax.training import metrics as metrics_lib


def test_progress_line_has_rates_mfu_eta_and_last_eval(capsys):
  progress = metrics_lib.Progress(total_steps=100, start_step=0, started_at=time.time())
  assert progress.rate(0) is None  # No step since the mark: no rate.
  progress.last_eval_loss, progress.last_accuracy = 2.5, 0.25
  progress.show(50, 2.0, 3.0, tokens_per_sec=65536.0, mfu=0.123)
  progress.show(1, None, 4.0)
  first, second = capsys.readouterr().out.splitlines()
  assert "2.00 steps/s    65,536 tokens/s MFU 12.3%" in first and "ETA 0:25" in first
  assert "loss 3.0000 | last eval loss 2.5000 acc 25.00%" in first
  assert "- steps/s" in second and "ETA -" in second


def test_elapsed_counts_from_the_command_start_and_a_resume_shows_its_last_eval(capsys):
  """"elapsed" and the start-up line's "first step after" count from the same point."""
  progress = metrics_lib.Progress(100, 40, started_at=time.time() - 65,
                                  last_eval={"eval/loss": 1.5, "eval/accuracy": 0.875})
  progress.show(41, None, 2.0)
  line = capsys.readouterr().out
  assert "elapsed 1:05 " in line and "last eval loss 1.5000 acc 87.50%" in line


def test_throughput_record_at_a_known_rate():
  # 2 steps/s of 4096 tokens; 1M parameters at 6 FLOPs each per token over 4 devices of 1e12.
  record = metrics_lib.throughput_metrics(2.0, 4096, 1_000_000, 1e12, 4)
  assert record == pytest.approx(
      {"perf/steps_per_sec": 2.0, "perf/tokens_per_sec": 8192.0, "perf/mfu": 0.012288})
  assert "perf/mfu" not in metrics_lib.throughput_metrics(2.0, 4096, 1_000_000, None, 4)


def test_startup_record_line_and_summary(capsys):
  timing = compile_cache.CompileTiming(lower_s=1.5, compile_s=20.25, cache_hits=0)
  record = metrics_lib.startup_metrics(timing, 42.0)
  assert record == {"perf/lower_s": 1.5, "perf/compile_s": 20.25,
                    "perf/compile_cache_hits": 0, "perf/time_to_first_step_s": 42.0}
  metrics_lib.Progress(10, 0, time.time()).show_startup(record)
  assert capsys.readouterr().out.strip() == (
      "first step after 42.0 s; train step traced in 1.5 s, compiled in 20.2 s "
      "(not from the compilation cache)")
  details = metrics_lib.summary_details(
      {"tokens_per_sec": 120000.0, "time_to_first_step_s": 31.0, "compile_s": 4.2,
       "last_eval": {"eval/loss": 3.21}})
  assert details == "; 120,000 tokens/s; first step after 31.0 s (compile 4.2 s); eval loss 3.2100"
  assert metrics_lib.summary_details({"tokens_per_sec": None, "last_eval": {}}) == ""
