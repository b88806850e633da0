"""benchmarks/head_loss_bench.py: each implementation checked against the float64 reference."""

import pytest

from benchmarks import head_loss_bench


@pytest.mark.parametrize("dtype, tolerance", [
    ("float32", 1e-5),
    ("bfloat16", 2e-2),
    # A GPU's default float32 matmuls are TF32 (10-bit products).
    pytest.param("float32", 2e-3, marks=pytest.mark.gpu)])
def test_rows_agree_with_the_reference(dtype, tolerance, tmp_path):
  result = head_loss_bench.main(["--shape", "2,64,32,300", "--dtype", dtype,
                                 "--iters", "2", "--records", str(tmp_path)])
  assert [r["implementation"] for r in result["rows"]] == ["logits", "sliced"]
  for row in result["rows"]:
    assert max(row["errors"]) < tolerance
    assert row["forward_ms"] > 0 and row["forward_backward_ms"] > 0
  assert len(list(tmp_path.glob("head_loss_bench_*.json"))) == 1


def test_unknown_implementations_are_refused():
  with pytest.raises(SystemExit):
    head_loss_bench.main(["--implementations", "pallas_gpu"])
