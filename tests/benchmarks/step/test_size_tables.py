"""benchmarks/step/size_tables.py on CPU: a tiny stage end to end, the budget, the rendering."""

import json

from benchmarks.step import size_tables


def test_tiny_stage_rows_and_table(tmp_path):
  stage = size_tables.run_stage(
      "tiny", ["--size", "tiny", "--models", "mamba2", "--seq_len", "32", "--batch_size", "2",
               "--steps", "1", "--warmup_steps", "0"], 300, tmp_path)
  assert stage["status"] == "ok" and stage["tokens_per_step"] == 64
  (row,) = stage["rows"]
  assert row["model"] == "mamba2" and row["tokens_per_s"] > 0 and row["peak_gib"] > 0
  assert row["x_mamba2"] == 1.0
  table = size_tables.render({"stages": {"tiny": stage}})
  assert "| mamba2 |" in table and "| 1.00 |" in table


def test_stages_left_without_budget_are_skipped(tmp_path):
  result = size_tables.main(["--output_dir", str(tmp_path), "--budget_s", "0",
                             "--stages", "2.7b,170m_scan"])
  assert [s["status"] for s in result["stages"].values()] == [
      "skipped: 0 s left of the budget"] * 2
  saved = json.loads((tmp_path / "size_tables.json").read_text())
  assert "--size 2.7b" in saved["stages"]["2.7b"]["command"]
