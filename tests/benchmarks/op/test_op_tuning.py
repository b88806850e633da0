"""benchmarks/op/tuning.py (Fast Palimpsa) on CPU: the small run (interpreted kernels) end to end,
its record, and the candidate lists of the GPU run."""

import json

import pytest

from benchmarks.op import tuning
from pallas_kernels.fast_palimpsa_gpu import reads


def test_small_run_checks_times_and_records(tmp_path, capsys):
  tuning.main(["--shapes", "small", "--iters", "1", "--warmup", "0", "--rotate", "1",
               "--records", str(tmp_path)])
  out = capsys.readouterr().out
  assert "WRONG" not in out and "| tiny | (1, 64, 1, 16, 16) | 64 | fwd+bwd |" in out
  assert "    (64, 16, 16): (16, 1, 64, 2)," in out
  [path] = tmp_path.glob("fast_palimpsa_tuning_*.json")
  record = json.loads(path.read_text())
  assert record["command"].startswith("python -m benchmarks.op.tuning --shapes small")
  modes = [row[3] for row in record["table"]["rows"]]
  assert modes == ["fwd", "fwd+bwd", "best"]


def test_a_candidate_that_fails_is_reported_and_the_run_goes_on(monkeypatch):
  runner = tuning._runner

  def failing(chunk, tiles, interpret, with_grads):
    if tiles is None:
      return runner(chunk, tiles, interpret, with_grads)
    def fail(*_):
      raise ValueError("Mosaic GPU kernel exceeds available shared memory | for example")
    return fail

  monkeypatch.setattr(tuning, "_runner", failing)
  args = tuning.parse_args(["--shapes", "small", "--no_record"])
  rows = tuning.tune_shape("tiny", tuning.SMALL["tiny"], 64, args, lambda: 0.0, print)
  assert [(r[3], r[6]) for r in rows] == [
      ("fwd", "FAILED: Mosaic GPU kernel exceeds available shared memory | for example")]
  assert "| FAILED: Mosaic GPU kernel exceeds available shared memory / for example |" in (
      tuning.format_table(rows))


def test_budget_stops_before_the_next_candidate(capsys):
  tuning.main(["--shapes", "small", "--budget_s", "1e-9", "--no_record"])
  assert "not reached: --budget_s" in capsys.readouterr().out


@pytest.mark.parametrize("name, vp, forwards, backwards", [
    ("D760", 192, 3, 2), ("D170", 48, 1, 2), ("K128", 128, 3, 2), ("MQAR", 32, 1, 2)])
def test_perf_candidates_fit_the_gpu(name, vp, forwards, backwards):
  """At C = 64, every forward candidate and the backward candidates that fit (the rest are
  skipped by the run) are accepted by reads.reads_call compiled."""
  import jax.numpy as jnp
  b, t, h, kd, vd = tuning.SHAPES["perf"][name]
  x = lambda d: jnp.zeros((1, 64, 1, d), jnp.bfloat16)
  fits = lambda tiles: tuning._reason((x(kd), x(kd), x(vd), x(vd)), 64, tiles) is None
  fwd = [f for f in tuning.forward_candidates(64, vp, False)
         if fits((f, reads.default_tiles(64, kd, vp, False)[1]))]
  bwd = [w for w in tuning.backward_candidates(64, vp, False) if fits((fwd[0], w))]
  assert (len(fwd), len(bwd)) == (forwards, backwards)


def test_bad_arguments_exit_with_one_line(capsys):
  with pytest.raises(SystemExit):
    tuning.main(["--shapes", "small", "--only", "D760"])
  assert "--only D760: not in --shapes small" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    tuning.main(["--chunks", "48"])
