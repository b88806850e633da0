"""The timing figures of benchmarks/step/throughput.py and step/decode.py on a fake clock.

Each test replaces the script's `time` by a clock that moves only while a fake train step runs
or a fake token is made, so the expected figures follow from the step times chosen here.
"""

import types

import jax
import ml_collections
import numpy as np
import pytest

from benchmarks.step import decode as decode_bench
from benchmarks.step import throughput as train_throughput


def _fake_built_step(step_seconds, clock):
  """A BuiltStep whose train step takes the next of step_seconds on `clock` (no JAX)."""
  durations = iter(step_seconds)

  def compiled(state, batch):
    del batch
    clock.now += next(durations)
    return state, {"train/finite": True, "train/loss": 1.5, "train/grad_norm": 1.0}

  config = ml_collections.ConfigDict({"model": {"implementation": "chunked", "num_layers": 2}})
  return train_throughput.BuiltStep(compiled, {}, {}, config, num_params=1000,
                                    grad_accum_steps=1, init_s=0.0, compile_s=0.0,
                                    temp_gib=None, peak_gib=None)


@pytest.mark.parametrize("model, step_seconds, synced, step_s, tokens_per_s", [
    ("mamba2", (5.0, 0.1, 0.4, 0.2, 0.2, 0.1, 0.3), (0.1, 0.2, 0.4), 0.2, 640.0),
    ("palimpsa_d", (5.0, 0.3, 0.6, 0.5, 0.5, 0.5, 0.5), (0.3, 0.5, 0.6), 0.5, 256.0),
])
def test_figures_are_those_of_the_queued_steps(monkeypatch, model, step_seconds, synced,
                                               step_s, tokens_per_s):
  """On a fake clock that moves only while a step runs: the warm-up step (5 s) is left out,
  three synced steps give the median, min and max, and the mean of the three queued steps
  gives the step time, tokens/s (2 x 64 tokens a step), MFU and run hours."""
  clock = types.SimpleNamespace(now=0.0)
  monkeypatch.setattr(train_throughput, "time",
                      types.SimpleNamespace(perf_counter=lambda: clock.now))
  monkeypatch.setattr(train_throughput, "build_train_step",
                      lambda *_: _fake_built_step(step_seconds, clock))
  monkeypatch.setattr(train_throughput.metrics_lib, "peak_flops_per_device", lambda: 1e12)
  args = train_throughput.parse_args(["--seq_len", "64", "--batch_size", "2", "--steps", "3",
                                      "--warmup_steps", "1"])
  row = train_throughput.bench_model(model, "chunked", True, args,
                                     train_throughput.placement(args, jax.devices()[:1]), model)
  assert (row["synced_ms_min"], row["synced_ms_median"], row["synced_ms_max"]) == pytest.approx(
      tuple(1e3 * s for s in synced))
  assert row["step_ms"] == pytest.approx(1e3 * step_s)
  assert row["tokens_per_s"] == pytest.approx(tokens_per_s)
  assert row["mfu"] == pytest.approx(6 * 1000 * tokens_per_s / 1e12)  # 6 FLOPs/param/token
  assert row["paper_run_hours"] == pytest.approx(15e9 / tokens_per_s / 3600)
  assert row["final_loss"] == 1.5 and row["params"] == 1000 and row["layers"] == 2


def test_baseline_ratio_is_the_step_time_over_mamba2s_with_the_same_scan_layers():
  rows = [{"model": "mamba2", "scan_layers": True, "step_ms": 200.0},
          {"model": "palimpsa_d", "scan_layers": True, "step_ms": 500.0},
          {"model": "palimpsa_d", "scan_layers": False, "step_ms": 300.0}]
  train_throughput.add_baseline_ratios(rows)
  assert [r["x_mamba2"] for r in rows] == [1.0, 2.5, None]



def test_rates_are_those_of_the_second_pass(monkeypatch):
  """On a fake clock that moves only while a token is made: a compiling pass (3 s, then 1 s
  a token), then the timed one: the first token after 0.5 s, steps of 0.1, 0.5 and 0.2 s."""
  clock = types.SimpleNamespace(now=0.0)
  passes = iter([(3.0, 1.0, 1.0, 1.0), (0.5, 0.1, 0.5, 0.2)])

  def stream(model, prompt, new_tokens, temperature):
    del model
    assert temperature == 0.0 and new_tokens == 4
    for seconds in next(passes):
      clock.now += seconds
      yield np.zeros(prompt.shape[0], np.int32)

  monkeypatch.setattr(decode_bench, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
  monkeypatch.setattr(decode_bench, "decoding", types.SimpleNamespace(stream=stream))
  row = decode_bench.bench_case(types.SimpleNamespace(vocab_size=50), "palimpsa_d", 1000,
                                batch=2, prompt_length=5, new_tokens=4)
  assert row["first_pass_s"] == pytest.approx(6.0)
  assert row["time_to_first_token_s"] == pytest.approx(0.5)
  assert row["step_s"] == pytest.approx([0.1, 0.5, 0.2])
  assert row["decode_ms_per_step"] == pytest.approx(200.0)  # The median step.
  assert row["decode_tokens_per_s"] == pytest.approx(10.0)  # 2 sequences a 0.2 s step.
  assert row["prefill_tokens_per_s"] == pytest.approx(20.0)  # 2 x 5 prompt tokens in 0.5 s.


def test_a_step_that_does_not_fit_gives_an_out_of_memory_row(monkeypatch):
  """The compiled step's figures stay; the table says what the step asked for."""
  clock = types.SimpleNamespace(now=0.0)
  monkeypatch.setattr(train_throughput, "build_train_step",
                      lambda *_: _fake_built_step((), clock))

  def no_memory(*_):
    raise jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 59.13GiB with allocator")

  monkeypatch.setattr(train_throughput, "_time_steps", no_memory)
  args = train_throughput.parse_args(["--seq_len", "64", "--batch_size", "2"])
  row = train_throughput.bench_model("palimpsa_d", "chunked", True, args,
                                     train_throughput.placement(args, jax.devices()[:1]), "p")
  assert row["error"] == "out of memory (allocating 59.13GiB)" and row["layers"] == 2
  train_throughput.add_baseline_ratios([row])
  table = train_throughput.format_table([row])
  assert "| out of memory (allocating 59.13GiB) | - |" in table
  assert train_throughput.projection_lines([row], 1) == []
