"""benchmarks/op/tuning.py on CPU: for Fast Palimpsa and the exact kernel, the small run
(interpreted kernels) end to end and its record, and the candidates of the GPU runs."""

import functools
import json

import jax
import jax.numpy as jnp
import pytest

from benchmarks.op import stages, tuning
from pallas_kernels.fast_palimpsa_gpu import reads
from pallas_kernels.palimpsa_gpu import config as gpu_config
from pallas_kernels.palimpsa_gpu import make_config


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


def test_a_chunk_whose_every_tiling_is_declined_says_why(monkeypatch):
  # The kernels' own default tiles may be taken where no candidate is (a chunk of 128).
  monkeypatch.setattr(tuning, "_reason",
                      lambda q_args, chunk, tiles: None if tiles is None else "too wide")
  args = tuning.parse_args(["--shapes", "small", "--no_record"])
  rows = tuning.tune_shape("tiny", tuning.SMALL["tiny"], 64, args, lambda: 0.0, print)
  assert [(r[3], r[6]) for r in rows] == [("fwd", "declined: too wide")]


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
    tuning.main(["--op", "palimpsa", "--only", "K128"])
  assert "--only K128: not in --shapes perf (its shapes: D170, M170, D760, MQAR)" in (
      capsys.readouterr().err)
  for argv in (["--chunks", "48"], ["--op", "gla"]):
    with pytest.raises(SystemExit):
      tuning.main(argv)


def test_palimpsa_small_run_times_each_stage_then_the_whole_op(tmp_path, capsys, monkeypatch):
  """Triton's default tiles (the interpreted Mosaic walks take seconds a call) and one
  variant, of the forward walk, so that the run stays short."""
  variants = tuning.palimpsa_variants
  monkeypatch.setattr(tuning, "palimpsa_variants", lambda base: [
      next(v for v in variants(base) if v[0] == "walk_fwd")])
  monkeypatch.setattr(tuning, "make_config", functools.partial(make_config, backend="triton"))
  tuning.main(["--op", "palimpsa", "--shapes", "small", "--iters", "1", "--warmup", "0",
               "--rotate", "1", "--records", str(tmp_path)])
  out = capsys.readouterr().out
  assert "WRONG" not in out and "FAILED" not in out
  [path] = tmp_path.glob("palimpsa_gpu_tuning_*.json")
  record = json.loads(path.read_text())
  assert record["command"].startswith("python -m benchmarks.op.tuning --op palimpsa")
  rows = record["table"]["rows"]
  assert [row[3] for row in rows[:4]] == ["boundary", "walk_fwd", "walk_fwd", "walk_bwd"]
  assert sorted(row[4].startswith("default") for row in rows[1:3]) == [False, True]
  assert [row[3] for row in rows[4:]] in (["fwd+bwd", "best"], ["fwd+bwd"] * 2 + ["best"])
  for mode in ("walk_fwd", "fwd+bwd"):
    ratios = [row[6] for row in rows if row[3] == mode]
    assert ratios[0] == "1.00" and all(float(r) >= 1 for r in ratios)
  fastest_walk = rows[1][4]  # The walk's fastest tiles go into the whole op's "fastest tiles".
  assert (rows[-1][7] == "the default tiles") == fastest_walk.startswith("default")


def test_each_palimpsa_variant_changes_its_own_stage(monkeypatch):
  """The tile variants of a D170 call on sm_90 (built on a CPU): each replaces the tiles of
  the stage it times, and only those; every stage has variants."""
  monkeypatch.setattr(gpu_config, "compute_capability", lambda: (9, 0))
  sds, bf16, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
  rows = sds((4, 4096, 16, 48), bf16)
  base = make_config(rows, rows, sds((4, 4096, 16), f32), sds((16,), f32),
                     return_variance=False, chunk_size=64, interpret=False)
  variants = tuning.palimpsa_variants(base)
  assert {stage for stage, _, _ in variants} == set(stages.STAGES)
  for stage, label, cfg in variants:
    changed = {s for s in gpu_config.STAGES if getattr(cfg, s) != getattr(base, s)}
    assert changed == {stages.OP_STAGES[stage]}, label
