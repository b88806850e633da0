"""benchmarks/op_profile.py: a CPU run of both modes, and argument checks."""

import json

import pytest

from benchmarks import op_profile
from benchmarks.step import profile as step_profile


def test_cpu_run_profiles_both_modes(tmp_path):
  out = tmp_path / "profile.json"
  result = op_profile.main([
      "--shapes", "small", "--shape", "tiny", "--impl", "chunked", "--calls", "2",
      "--warmup", "1", "--top", "5", "--trace_dir", str(tmp_path / "trace"),
      "--output", str(out), "--records", str(tmp_path / "records")])
  saved = json.loads(out.read_text())
  assert saved == json.loads(json.dumps(result))
  assert saved["dims"] == [1, 256, 2, 16, 16] and set(saved["modes"]) == {"fwd", "fwd+bwd"}
  for mode in saved["modes"].values():
    kernels = mode["kernels"]
    assert mode["wall_ms"] > 0 and kernels
    assert all(k["ms_per_step"] >= 0 for k in kernels)
    assert {k["category"] for k in kernels} <= set(step_profile.CATEGORIES)
    assert any(k["source"].startswith("palimpsa_jax/ops/") for k in kernels)
  # The backward adds kernels of its own.
  assert len(saved["modes"]["fwd+bwd"]["kernels"]) > len(saved["modes"]["fwd"]["kernels"])
  records = [json.loads(p.read_text()) for p in sorted((tmp_path / "records").glob("*.json"))]
  assert sorted(r["settings"]["mode"] for r in records) == ["fwd", "fwd+bwd"]
  for record in records:
    mode = saved["modes"][record["settings"]["mode"]]
    assert record["figures"]["wall_ms_per_call"] == mode["wall_ms"]
    assert len(record["table"]["rows"]) == min(5, len(mode["kernels"]))
    assert record["table"]["rows"][0][0] == mode["kernels"][0]["name"][:60]


@pytest.mark.parametrize("argv", [["--shape", "D999"], ["--shapes", "small", "--shape", "D170"],
                                  ["--impl", "fast"], ["--calls", "0"], ["--warmup", "-1"],
                                  ["--modes", "bwd"]])
def test_bad_arguments_exit(argv):
  with pytest.raises(SystemExit):
    op_profile.parse_args(argv)
