"""benchmarks/step/decode.py end to end on CPU with a tiny model."""

import json

import pytest

from benchmarks.step import decode as decode_bench


def test_main_writes_table_json_plot_and_results(tmp_path):
  records, output, plot = tmp_path / "records", tmp_path / "out.json", tmp_path / "rates.png"
  argv = ["--models", "palimpsa_d", "--size", "tiny", "--batches", "2", "--prompt_lengths",
          "5", "--new_tokens", "3", "--output", str(output), "--plot", str(plot),
          "--records", str(records)]
  result = decode_bench.main(argv)
  (row,) = result["rows"]
  assert (row["model"], row["batch"], row["prompt_length"], row["new_tokens"]) == (
      "palimpsa_d", 2, 5, 3)
  assert len(row["step_s"]) == 2 and row["decode_tokens_per_s"] > 0
  assert json.loads(output.read_text())["rows"][0]["batch"] == 2
  assert plot.stat().st_size > 0
  (path,) = records.glob("decode_bench_*.json")
  record = json.loads(path.read_text())
  assert record["title"] == "decode_bench tiny, 3 new tokens"
  assert "--prompt_lengths 5" in record["command"] and record["git_ref"]
  (row_cells,) = record["table"]["rows"]
  assert (row_cells[0], row_cells[2], row_cells[3]) == ("palimpsa_d", "2", "5")


@pytest.mark.parametrize("flags, message", [
    (["--models", "lstm"], "--models"), (["--new_tokens", "1"], "--new_tokens"),
    (["--batches", "0"], "--batches")])
def test_bad_arguments_exit(flags, message, capsys):
  with pytest.raises(SystemExit):
    decode_bench.parse_args(flags)
  assert message in capsys.readouterr().err
