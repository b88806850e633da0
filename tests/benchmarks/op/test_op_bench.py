"""benchmarks/op/bench.py on CPU: the side by side comparison (correctness gate, timing rows,
records) and the comparison of git refs in one process."""

import argparse
import json
import math
import sys

import jax
import jax.numpy as jnp
import pytest

from benchmarks.op import bench, fla, git_refs, timing


def test_bench_shape_checks_truncated_gradients_then_times():
  # A tiny --max-ref-gib makes the float64 gradients cover only the first chunk, so the
  # full-length gradients go through the finite check as well.
  args = argparse.Namespace(dtype="float32", rotate=1, chunk_size=16, max_ref_gib=1e-9,
                            max_state_gib=16.0, variance=False, memory=True, warmup=1,
                            iters=1)
  logs = []
  rows = bench.bench_shape("tiny", (1, 64, 2, 16, 16), ["chunked"], args, logs.append)
  assert [(r[2], r[3]) for r in rows] == [("chunked", "fwd"), ("chunked", "fwd+bwd")]
  for _, _, _, mode, ms, ms_synced, err, mem in rows:
    assert ms is not None and ms > 0 and ms_synced > 0, (mode, err)
    assert mem is not None
  assert "T=16" in rows[1][6]
  table = bench.format_table(rows, True)
  assert "WRONG" not in table and "| ms | ms synced |" in table


def test_time_queued_counts_every_call():
  calls = []

  def fn(x):
    calls.append(x)
    return x

  ms = timing.time_queued(fn, [(1,), (2,)], warmup=1, iters=4, batches=3)
  assert ms >= 0
  assert calls == [1] + [1, 2, 1, 2] * 3


def test_only_names_a_shape_of_the_chosen_set(monkeypatch, capsys):
  monkeypatch.setattr("sys.argv", ["bench.py", "--only", "MQAR", "--no_record"])
  with pytest.raises(SystemExit):
    bench.main()
  assert "--only MQAR: not in --shapes small (its shapes: tiny, tail, wide)" in (
      capsys.readouterr().err)


def test_fla_rows_say_why_they_are_skipped_and_fill_their_column():
  """Without torch/FLA (CI) the FLA rows say why; with timings, the table gives each
  Palimpsa row's ratio to FLA's Gated DeltaNet and no floor fraction or speed-up for FLA."""
  shape = (1, 64, 2, 16, 16)
  rows, notes = fla.rows("tiny", shape, lambda _: None)
  assert [(r[2], r[3]) for r in rows] == [(i, m) for i in fla.IMPLS for m in ("fwd", "fwd+bwd")]
  assert all(r[4] is None and r[6].startswith("skipped: ") for r in rows) and not notes
  assert "x FLA Gated DeltaNet" not in bench.format_table(rows, False)
  gdn_only, _ = fla.rows("tiny", shape, lambda _: None, ("fla_gated_deltanet",))
  assert {r[2] for r in gdn_only} == {"fla_gated_deltanet"} and len(gdn_only) == 2
  timed = [("D", shape, "pallas_gpu", "fwd", 2.0, 2.5, "1e-06 (ref)", None),
           ("D", shape, "chunked", "fwd", 8.0, 8.5, "1e-06 (ref)", None),
           ("D", shape, "fla_gated_deltanet", "fwd", 1.0, None, "n/a", None),
           ("D", shape, "fla_simple_gla", "fwd", 0.5, None, "n/a", None)]
  lines = bench.format_table(timed, False).splitlines()
  assert lines[0].endswith("| x FLA Gated DeltaNet |")
  cells = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[2:]]
  assert cells[0][7] == "4.00x" and cells[0][-1] == "0.50x"  # pallas_gpu vs chunked, FLA
  assert cells[1][-1] == "0.12x"
  assert cells[2][5] == "-" and cells[2][7:9] == ["-", "-"] and cells[2][-1] == "-"


def test_fla_versions_name_the_installed_packages_only(monkeypatch):
  installed = {"torch": "2.11.0", "triton": "3.6.0", "fla-core": "0.6.0"}

  def version(package):
    if package not in installed:
      raise fla.importlib.metadata.PackageNotFoundError(package)
    return installed[package]

  monkeypatch.setattr(fla.importlib.metadata, "version", version)
  assert fla.versions() == installed


def test_record_is_rewritten_after_every_shape(monkeypatch, tmp_path):
  """A run stopped during its second shape keeps the first one's rows in a record marked
  partial; a finished run leaves one record, not marked."""
  shapes = {"first": (1, 64, 1, 16, 16), "second": (1, 64, 1, 16, 16)}
  monkeypatch.setitem(bench.SHAPES, "small", shapes)
  argv = ["bench.py", "--impls", "chunked", "--iters", "1", "--warmup", "0",
          "--rotate", "1", "--records", str(tmp_path)]
  monkeypatch.setattr("sys.argv", argv)
  real_bench = bench.bench_shape

  def stop_at_second(name, *args):
    if name == "second":
      raise KeyboardInterrupt
    return real_bench(name, *args)

  monkeypatch.setattr(bench, "bench_shape", stop_at_second)
  with pytest.raises(KeyboardInterrupt):
    bench.main()
  (path,) = tmp_path.glob("op_bench_*.json")
  record = json.loads(path.read_text())
  assert [row[0] for row in record["table"]["rows"]] == ["first", "first"]
  assert any(n.startswith("partial: the run had not reached second") for n in record["notes"])
  path.unlink()
  monkeypatch.setattr(bench, "bench_shape", real_bench)
  bench.main()
  (path,) = tmp_path.glob("op_bench_*.json")
  record = json.loads(path.read_text())
  assert [row[0] for row in record["table"]["rows"]] == ["first"] * 2 + ["second"] * 2
  assert not any(n.startswith("partial") for n in record["notes"])


def test_fast_palimpsa_rows_are_checked_against_their_own_reference():
  """The fast_palimpsa rows pass against Fast Palimpsa's float64 reference (they would fail
  against the exact op's: beta varies over V) beside the exact op's rows."""
  args = argparse.Namespace(dtype="float32", rotate=1, chunk_size=16, max_ref_gib=16.0,
                            max_state_gib=16.0, variance=True, memory=False, warmup=1,
                            iters=1)
  rows = bench.bench_shape("tiny", (1, 40, 2, 8, 8), ["chunked", bench.FAST], args,
                           lambda msg: None)
  assert [(r[2], r[3]) for r in rows] == [
      ("chunked", "fwd"), ("chunked", "fwd+bwd"), ("fast_palimpsa", "fwd"),
      ("fast_palimpsa", "fwd+bwd")]
  assert all(r[4] is not None and r[4] > 0 for r in rows), rows


def _fast_reference_backward_gib(shape, chunk):
  """Compiled temp memory of Fast Palimpsa's float64 reference backward at this shape."""
  b, t, h, kd, vd = shape
  sds = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.float64)
  args = (sds(b, t, h, kd),) * 2 + (sds(b, t, h, vd),) * 2 + (sds(b, t, h), sds(h))
  with jax.enable_x64(True):
    compiled = bench._reference.lower(args, sds(b, t, h, vd), with_grads=True,
                                      fast_chunk=chunk).compile()
  return compiled.memory_analysis().temp_size_in_bytes / 2**30


def test_fast_reference_gradients_fit_max_ref_gib():
  """Fast Palimpsa's float64 reference keeps several times the exact op's 4 states per step:
  where the exact op's rule would check all T steps (and ask for several times the budget,
  as it did at MQAR and D170 on a GPU), its gradients are checked on the steps that fit."""
  shape, chunk = (1, 64, 1, 8, 8), 8
  budget = bench.reference_gib_per_step(shape) * shape[1]
  assert bench.reference_steps(shape, budget, chunk) == shape[1]
  ref_t = bench.reference_steps(shape, budget, chunk, fast_chunk=chunk)
  assert chunk <= ref_t < shape[1]
  assert _fast_reference_backward_gib(shape[:1] + (ref_t,) + shape[2:], chunk) <= budget


@pytest.mark.parametrize("ref_steps", [32, 0])
def test_ref_steps_caps_or_skips_the_float64_check(ref_steps):
  """--ref_steps N checks outputs and gradients on the first N steps (the rows say T=N); 0
  skips the reference and only requires finite outputs and gradients."""
  args = argparse.Namespace(dtype="float32", rotate=1, chunk_size=16, max_ref_gib=16.0,
                            max_state_gib=16.0, variance=True, memory=False, warmup=0,
                            iters=1, ref_steps=ref_steps)
  rows = bench.bench_shape("tiny", (1, 64, 2, 16, 16), ["chunked", "fast_palimpsa"], args,
                           lambda _: None)
  assert len(rows) == 4 and all(r[4] is not None for r in rows), rows
  notes = [r[6] for r in rows]
  if ref_steps:
    assert all("(ref, T=32)" in note for note in notes), notes
  else:
    assert all(note.endswith("(unchecked, finite)") for note in notes), notes


def test_ref_steps_still_catches_a_wrong_implementation(monkeypatch):
  """A capped check compares the prefix: an implementation off by a constant is WRONG."""
  right = bench.palimpsa

  def wrong(*a, **k):
    result = right(*a, **k)
    return result._replace(out=result.out + 1.0)

  monkeypatch.setattr(bench, "palimpsa", wrong)
  args = argparse.Namespace(dtype="float32", rotate=1, chunk_size=16, max_ref_gib=16.0,
                            max_state_gib=16.0, variance=False, memory=False, warmup=0,
                            iters=1, ref_steps=32)
  rows = bench.bench_shape("tiny", (1, 64, 2, 16, 16), ["chunked"], args, lambda _: None)
  assert rows[0][6].startswith("WRONG: rel. error") and rows[0][4] is None


def test_an_implementation_that_fails_is_a_row_and_the_run_exits_nonzero(monkeypatch, tmp_path,
                                                                          capsys):
  """A kernel that fails to lower at one shape gives FAILED rows naming the error; the other
  implementations are still measured, the record is written and the run exits non-zero."""
  right = bench.palimpsa

  def fails_for_chunked(*a, implementation, **k):
    if implementation == "chunked":
      raise NotImplementedError("copies of 64 bytes are not supported\nsecond line")
    return right(*a, implementation=implementation, **k)

  monkeypatch.setattr(bench, "palimpsa", fails_for_chunked)
  monkeypatch.setitem(bench.SHAPES, "small", {"tiny": (1, 32, 1, 8, 8)})
  monkeypatch.setattr("sys.argv", ["bench.py", "--impls", "chunked", "sequential",
                                   "--iters", "1", "--warmup", "0", "--rotate", "1",
                                   "--records", str(tmp_path)])
  with pytest.raises(SystemExit, match="wrong or failed rows: tiny chunked fwd, tiny chunked"):
    bench.main()
  (path,) = tmp_path.glob("op_bench_*.json")
  rows = json.loads(path.read_text())["table"]["rows"]
  failed = [r for r in rows if "chunked" in r]
  assert len(failed) == 2 and all(
      "FAILED: NotImplementedError: copies of 64 bytes are not supported" in r
      for r in failed), failed
  timed = [r for r in rows if "sequential" in r]
  assert len(timed) == 2 and "FAILED" not in str(timed)
  assert "FAILED NotImplementedError" in capsys.readouterr().err


needs_git = pytest.mark.skipif(not (git_refs.REPO / ".git").exists(),
                               reason="needs the git checkout")


@needs_git
def test_a_ref_imports_from_its_export_and_the_modules_come_back(tmp_path):
  before = sys.modules.get("palimpsa_jax.ops")
  root = git_refs.export("HEAD", tmp_path)
  with git_refs.packages_from(root):
    import palimpsa_jax.ops  # pylint: disable=import-outside-toplevel
    assert palimpsa_jax.ops.__file__.startswith(str(tmp_path))
    assert callable(palimpsa_jax.ops.palimpsa)
  assert sys.modules.get("palimpsa_jax.ops") is before
  assert str(root) not in sys.path


@needs_git
def test_refs_compares_two_refs_in_one_process(tmp_path):
  rows = bench.main(["--refs", "HEAD", ".", "--shapes", "small", "--only", "tiny",
                     "--impls", "chunked", "--modes", "fwd", "fwd+bwd", "--rounds", "2",
                     "--warmup", "1", "--iters", "2", "--rotate", "1", "--records",
                     str(tmp_path)])
  assert [(r["mode"], r["ref"]) for r in rows] == [
      ("fwd", "HEAD"), ("fwd", "."), ("fwd+bwd", "HEAD"), ("fwd+bwd", ".")]
  for r in rows:
    assert len(r["ms"]) == 2 and all(t > 0 for t in r["ms"])
    assert r["median_ms"] > 0 and math.isfinite(r["max_rel_difference"])
    assert r["first_call_s"] > 0
  first = [r for r in rows if r["ref"] == "HEAD"]
  assert all(r["speed_up"] == 1.0 and r["max_rel_difference"] == 0.0 for r in first)
  assert rows[1]["commit"].startswith("working tree (")
  table = bench.format_refs_table(rows)
  assert table.count("\n") == len(rows) + 1 and "| tiny |" in table
  (path,) = tmp_path.glob("op_ab_*.json")
  record = json.loads(path.read_text())
  assert record["command"].startswith("python -m benchmarks.op.bench --refs HEAD . ")
  assert record["settings"]["refs"] == ["HEAD", "."] and len(record["table"]["rows"]) == 4


@needs_git
def test_an_unknown_ref_is_refused_in_one_line():
  with pytest.raises(SystemExit, match="^op bench: --refs: 'no-such-ref-anywhere' is not a commit"):
    bench.main(["--refs", ".", "no-such-ref-anywhere", "--no_record"])


@pytest.mark.parametrize("argv, message", [
    (["--refs", "HEAD"], "--refs needs at least two refs"),
    (["--refs", "HEAD", ".", "--only", "D999"], "--only D999: not in --shapes small"),
    (["--refs", "HEAD", ".", "--modes", "bwd"], "--modes: invalid choice"),
    (["--refs", "HEAD", ".", "--rounds", "0"], "--rounds"),
    (["--refs", "HEAD", ".", "--impls", "chunked", "sequential"], "--impls with --refs: one"),
    (["--refs", "HEAD", ".", "--impls", "fast_palimpsa"], "--impls with --refs: one"),
    (["--refs", "HEAD", ".", "--fla", "--memory"], "--fla, --memory: not with --refs"),
    (["--rounds", "2"], "--rounds: only with --refs"),
    (["--modes", "fwd", "--rounds", "2"], "--modes and --rounds: only with --refs"),
    (["--ref_steps", "-1"], "--ref_steps"),
])
def test_bad_arguments_exit_with_one_line(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    bench.parse_args(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err.strip().splitlines()[-1]
