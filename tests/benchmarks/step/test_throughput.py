"""benchmarks/step/throughput.py end to end on CPU with tiny models."""

import json

import pytest

from benchmarks.step import throughput as train_throughput


def test_run_plan_compares_palimpsa_d_implementations():
  args = train_throughput.parse_args(
      ["--models", "palimpsa_d,mamba2,meta_mamba2",
       "--compare_implementations", "pallas_gpu,chunked"])
  assert train_throughput.run_plan(args) == [
      ("palimpsa_d", "pallas_gpu", False), ("palimpsa_d", "chunked", False),
      ("mamba2", "auto", False), ("meta_mamba2", "auto", False)]
  both = train_throughput.parse_args(["--models", "mamba2", "--scan_layers", "both"])
  assert train_throughput.run_plan(both) == [("mamba2", "auto", True),
                                             ("mamba2", "auto", False)]
  assert train_throughput.model_implementation("gated_deltanet", "pallas_gpu") == "auto"
  assert train_throughput.model_implementation("gated_deltanet", "chunked") == "chunked"
  assert train_throughput.model_implementation("mamba2", "pallas_gpu") == "pallas_gpu"
  assert train_throughput.model_implementation("transformer", "chunked") == "auto"
  default = train_throughput.parse_args([])
  assert [name for name, _, _ in train_throughput.run_plan(default)] == [
      "palimpsa_d", "not_palimpsa", "mamba2", "gated_deltanet"]


@pytest.mark.parametrize("flags, message", [
    (["--implementation", "fast"], "implementation must be one of"),
    (["--models", "mamba3"], "--models"),
])
def test_run_plan_rejects_unknown_names(flags, message):
  with pytest.raises(ValueError, match=message):
    train_throughput.run_plan(train_throughput.parse_args(flags))


def test_main_writes_table_results_and_json(tmp_path, capsys):
  records, output = tmp_path / "records", tmp_path / "out.json"
  argv = ["--models", "mamba2", "--compare_implementations", "chunked",
          "--size", "tiny", "--seq_len", "64", "--batch_size", "2", "--steps", "2",
          "--warmup_steps", "1", "--scan_layers", "both", "--no_kernel_sharding",
          "--records", str(records),
          "--output", str(output)]
  result = train_throughput.main(argv)

  rows = result["rows"]
  assert [(r["model"], r["implementation"], r["scan_layers"]) for r in rows] == [
      ("mamba2", "auto", True), ("mamba2", "auto", False),
      ("palimpsa_d", "chunked", True), ("palimpsa_d", "chunked", False)]
  assert rows[0]["x_mamba2"] == pytest.approx(1.0)
  assert rows[1]["x_mamba2"] == pytest.approx(1.0)  # Against the unrolled Mamba2.
  for row in rows:
    assert row["synced_ms_min"] <= row["synced_ms_median"] <= row["synced_ms_max"]
    assert row["step_ms"] > 0
    assert row["compile_s"] > 0 and row["final_loss"] > 0
  assert len(result["projections"]) == 2 and "Palimpsa-D chunked" in result["projections"][0]

  printed = capsys.readouterr().out
  assert "| mamba2 | auto | yes |" in printed and "| palimpsa_d | chunked | no |" in printed
  (path,) = records.glob("train_throughput_*.json")
  record = json.loads(path.read_text())
  assert record["command"].startswith("python -m benchmarks.step.throughput ")
  assert "--compare_implementations chunked" in record["command"]
  assert "kernels on the global batch" in record["notes"][0] and not result["kernel_sharding"]
  assert record["settings"]["size"] == "tiny" and "15B tokens" in record["notes"][1]
  assert record["table"]["columns"][:3] == ["model", "implementation", "scanned"]
  assert record["table"]["rows"][3][:3] == ["palimpsa_d", "chunked", "no"]
  assert json.loads(output.read_text())["rows"][2]["model"] == "palimpsa_d"


@pytest.mark.slow  # Compiles two train steps: about a minute on 2 CPU cores.
def test_precision_rank1_rows_name_fast_palimpsa():
  argv = ["--models", "palimpsa_d,gated_deltanet", "--precision", "rank1", "--size", "tiny",
          "--seq_len", "32", "--batch_size", "2", "--steps", "1", "--warmup_steps", "0",
          "--no_kernel_sharding", "--no_record"]
  rows = train_throughput.main(argv)["rows"]
  assert [(r["model"], r["implementation"]) for r in rows] == [
      ("palimpsa_d", "fast_palimpsa (rank1)"), ("gated_deltanet", "auto")]
