"""benchmarks/decode_bench.py end to end on CPU with a tiny model."""

import json
import types

import numpy as np
import pytest

from benchmarks import decode_bench


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


def test_main_writes_table_json_plot_and_results(tmp_path):
  results, output, plot = tmp_path / "RESULTS.md", tmp_path / "out.json", tmp_path / "rates.png"
  argv = ["--models", "palimpsa_d", "--size", "tiny", "--batches", "2", "--prompt_lengths",
          "5", "--new_tokens", "3", "--output", str(output), "--plot", str(plot),
          "--results", str(results)]
  result = decode_bench.main(argv)
  (row,) = result["rows"]
  assert (row["model"], row["batch"], row["prompt_length"], row["new_tokens"]) == (
      "palimpsa_d", 2, 5, 3)
  assert len(row["step_s"]) == 2 and row["decode_tokens_per_s"] > 0
  assert json.loads(output.read_text())["rows"][0]["batch"] == 2
  assert plot.stat().st_size > 0
  section = results.read_text()
  assert "decode_bench tiny, 3 new tokens" in section and "--prompt_lengths 5" in section
  assert "| palimpsa_d |" in section and "git " in section


@pytest.mark.parametrize("flags, message", [
    (["--models", "lstm"], "--models"), (["--new_tokens", "1"], "--new_tokens"),
    (["--batches", "0"], "--batches")])
def test_bad_arguments_exit(flags, message, capsys):
  with pytest.raises(SystemExit):
    decode_bench.parse_args(flags)
  assert message in capsys.readouterr().err
