"""benchmarks/op_bench.py on CPU: correctness gate and timing rows of one small shape."""

import argparse

import pytest

from benchmarks import op_bench


def test_bench_shape_checks_truncated_gradients_then_times():
  # A tiny --max-ref-gib makes the float64 gradients cover only the first chunk, so the
  # full-length gradients go through the finite check as well.
  args = argparse.Namespace(dtype="float32", rotate=1, chunk_size=16, max_ref_gib=1e-9,
                            max_state_gib=16.0, variance=False, memory=True, warmup=1,
                            iters=1)
  logs = []
  rows = op_bench.bench_shape("tiny", (1, 64, 2, 16, 16), ["chunked"], args, logs.append)
  assert [(r[2], r[3]) for r in rows] == [("chunked", "fwd"), ("chunked", "fwd+bwd")]
  for _, _, _, mode, ms, ms_synced, err, mem in rows:
    assert ms is not None and ms > 0 and ms_synced > 0, (mode, err)
    assert mem is not None
  assert "T=16" in rows[1][6]
  table = op_bench.format_table(rows, True)
  assert "WRONG" not in table and "| ms | ms synced |" in table


def test_time_queued_counts_every_call():
  calls = []

  def fn(x):
    calls.append(x)
    return x

  ms = op_bench.time_queued(fn, [(1,), (2,)], warmup=1, iters=4, batches=3)
  assert ms >= 0
  assert calls == [1] + [1, 2, 1, 2] * 3


def test_only_names_a_shape_of_the_chosen_set(monkeypatch, capsys):
  monkeypatch.setattr("sys.argv", ["op_bench.py", "--only", "MQAR", "--no_record"])
  with pytest.raises(SystemExit):
    op_bench.main()
  assert "--only MQAR: not in --shapes small (its shapes: tiny, tail, wide)" in (
      capsys.readouterr().err)
