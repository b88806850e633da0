"""benchmarks/head_loss_bench.py: each implementation checked against the unfused loss."""

import pytest

from benchmarks import head_loss_bench


@pytest.mark.parametrize("implementations", [
    "unfused,xla", pytest.param("unfused,xla,pallas_gpu", marks=pytest.mark.gpu)])
def test_rows_agree_with_the_unfused_loss(implementations, tmp_path):
  result = head_loss_bench.main(["--shape", "2,64,32,300", "--implementations",
                                 implementations, "--iters", "2", "--records", str(tmp_path)])
  assert [r["implementation"] for r in result["rows"]] == implementations.split(",")
  tolerance = 2e-3 if "pallas_gpu" in implementations else 1e-5  # A GPU's TF32 products.
  for row in result["rows"]:
    assert max(row["errors"]) < tolerance
    assert row["forward_ms"] > 0 and row["forward_backward_ms"] > 0
  assert len(list(tmp_path.glob("head_loss_bench_*.json"))) == 1


def test_unknown_implementations_are_refused():
  with pytest.raises(SystemExit):
    head_loss_bench.main(["--implementations", "cuda"])
