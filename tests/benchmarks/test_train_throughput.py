"""benchmarks/train_throughput.py end to end on CPU with tiny models."""

import json
import types

import jax
import ml_collections
import pytest

from benchmarks import train_throughput


def test_run_plan_compares_palimpsa_d_implementations():
  args = train_throughput.parse_args(
      ["--models", "palimpsa_d,mamba2", "--meta_mamba2",
       "--compare_implementations", "pallas_gpu,chunked"])
  assert train_throughput.run_plan(args) == [
      ("palimpsa_d", "pallas_gpu", False), ("palimpsa_d", "chunked", False),
      ("mamba2", "auto", False), ("meta_mamba2", "auto", False)]
  both = train_throughput.parse_args(["--models", "mamba2", "--scan_layers", "both"])
  assert train_throughput.run_plan(both) == [("mamba2", "auto", True),
                                             ("mamba2", "auto", False)]
  assert train_throughput.model_implementation("gated_deltanet", "pallas_gpu") == "auto"


@pytest.mark.parametrize("flags, message", [
    (["--implementation", "fast"], "implementation must be one of"),
    (["--models", "mamba3"], "--models"),
])
def test_run_plan_rejects_unknown_names(flags, message):
  with pytest.raises(ValueError, match=message):
    train_throughput.run_plan(train_throughput.parse_args(flags))


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


@pytest.mark.parametrize("model, step_seconds, step_s, tokens_per_s", [
    ("mamba2", (5.0, 0.1, 0.4, 0.2), 0.2, 640.0),
    ("palimpsa_d", (5.0, 0.3, 0.6, 0.5), 0.5, 256.0),
])
def test_figures_are_those_of_the_median_timed_step(monkeypatch, model, step_seconds, step_s,
                                                    tokens_per_s):
  """On a fake clock that moves only while a step runs: the warm-up step (5 s) is left out,
  the median of the timed steps gives tokens/s (2 x 64 tokens a step), MFU and run hours."""
  clock = types.SimpleNamespace(now=0.0)
  monkeypatch.setattr(train_throughput, "time",
                      types.SimpleNamespace(perf_counter=lambda: clock.now))
  monkeypatch.setattr(train_throughput, "build_train_step",
                      lambda *_: _fake_built_step(step_seconds, clock))
  monkeypatch.setattr(train_throughput.metrics_lib, "peak_flops_per_device", lambda: 1e12)
  args = train_throughput.parse_args(["--seq_len", "64", "--batch_size", "2", "--steps", "3",
                                      "--warmup_steps", "1"])
  mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
  row = train_throughput.bench_model(model, "chunked", True, args, mesh, model)
  assert (row["step_ms_min"], row["step_ms_median"], row["step_ms_max"]) == pytest.approx(
      (1e3 * min(step_seconds[1:]), 1e3 * step_s, 1e3 * max(step_seconds[1:])))
  assert row["tokens_per_s"] == pytest.approx(tokens_per_s)
  assert row["mfu"] == pytest.approx(6 * 1000 * tokens_per_s / 1e12)  # 6 FLOPs/param/token
  assert row["paper_run_hours"] == pytest.approx(15e9 / tokens_per_s / 3600)
  assert row["final_loss"] == 1.5 and row["params"] == 1000 and row["layers"] == 2


def test_baseline_ratio_is_the_step_time_over_mamba2s_with_the_same_scan_layers():
  rows = [{"model": "mamba2", "scan_layers": True, "step_ms_median": 200.0},
          {"model": "palimpsa_d", "scan_layers": True, "step_ms_median": 500.0},
          {"model": "palimpsa_d", "scan_layers": False, "step_ms_median": 300.0}]
  train_throughput.add_baseline_ratios(rows)
  assert [r["x_mamba2"] for r in rows] == [1.0, 2.5, None]


def test_main_writes_table_results_and_json(tmp_path, capsys):
  results, output = tmp_path / "RESULTS.md", tmp_path / "out.json"
  argv = ["--models", "mamba2", "--compare_implementations", "chunked",
          "--size", "tiny", "--seq_len", "64", "--batch_size", "2", "--steps", "2",
          "--warmup_steps", "1", "--scan_layers", "both", "--no_kernel_sharding",
          "--results", str(results),
          "--output", str(output)]
  result = train_throughput.main(argv)

  rows = result["rows"]
  assert [(r["model"], r["implementation"], r["scan_layers"]) for r in rows] == [
      ("mamba2", "auto", True), ("mamba2", "auto", False),
      ("palimpsa_d", "chunked", True), ("palimpsa_d", "chunked", False)]
  assert rows[0]["x_mamba2"] == pytest.approx(1.0)
  assert rows[1]["x_mamba2"] == pytest.approx(1.0)  # Against the unrolled Mamba2.
  for row in rows:
    assert row["step_ms_min"] <= row["step_ms_median"] <= row["step_ms_max"]
    assert row["compile_s"] > 0 and row["final_loss"] > 0
  assert len(result["projections"]) == 2 and "Palimpsa-D chunked" in result["projections"][0]

  printed = capsys.readouterr().out
  assert "| mamba2 | auto | yes |" in printed and "| palimpsa_d | chunked | no |" in printed
  recorded = results.read_text()
  assert "--compare_implementations chunked" in recorded
  assert "kernels on the global batch" in recorded and not result["kernel_sharding"]
  assert result["table"] in recorded and "15B tokens" in recorded
  assert json.loads(output.read_text())["rows"][2]["model"] == "palimpsa_d"
