"""benchmarks/gpu_round.py: the plan of a GPU round, its budget, and a tiny round on CPU."""

import json
import pathlib
import sys

import pytest

from benchmarks import gpu_round


def _plan(argv, tmp_path):
  return gpu_round.plan(gpu_round.parse_args(argv), tmp_path, tmp_path / "traces")


def test_the_gpu_round_plans_every_measurement(tmp_path):
  parts = _plan([], tmp_path)
  assert [p.name for p in parts] == ["tests", "op", "step760 exact", "step760 rank1",
                                     "profile760", "mqar"]
  by_name = {p.name: " ".join(p.argv) for p in parts}
  assert by_name["tests"].startswith("-m pytest -m gpu") and "tests/pallas_kernels" in (
      by_name["tests"])
  assert "--only D760 D170 K128 MQAR" in by_name["op"] and "--ref_steps 512" in by_name["op"]
  assert "--impls pallas_gpu fast_palimpsa_gpu" in by_name["op"]
  for precision in ("exact", "rank1"):
    command = by_name[f"step760 {precision}"]
    assert "--size 760m --batch_size 8 --as_shipped" in command
    assert f"--precision {precision}" in command
  assert "--size 760m --batch_size 4 --scan_layers" in by_name["profile760"]
  assert by_name["profile760"].startswith("-m benchmarks.step.profile --size 760m")
  assert by_name["mqar"].startswith("-m benchmarks.step.profile --mqar --steps")
  # Every part's record goes to the round's folder.
  assert all(f"--records {tmp_path}" in command for name, command in by_name.items()
             if name != "tests")
  assert sum(p.cap_s for p in parts if p.name != "tests") <= 600


def test_skip_tests_and_only_choose_parts(tmp_path):
  assert "tests" not in [p.name for p in _plan(["--skip_tests"], tmp_path)]
  assert [p.name for p in _plan(["--only", "step760", "mqar"], tmp_path)] == [
      "step760 exact", "step760 rank1", "mqar"]


def test_budget_stops_a_long_part_and_skips_what_no_longer_fits(tmp_path, monkeypatch, capsys):
  """A part is killed at the budget's end ("out of time") and later parts whose minimum no
  longer fits are skipped; the summary says so and the round still writes its record."""
  sleep = lambda s: ("-c", f"import time; time.sleep({s})")
  parts = [gpu_round.Part("op", sleep(30), cap_s=30, min_s=0.1),
           gpu_round.Part("mqar", sleep(0), cap_s=10, min_s=5)]
  monkeypatch.setattr(gpu_round, "plan", lambda *_: parts)
  monkeypatch.setattr(gpu_round, "fla_installed", lambda: False)
  result = gpu_round.main(["--budget_s", "2", "--out", str(tmp_path)])
  statuses = [o["status"] for o in result["outcomes"]]
  assert statuses[0] == "out of time" and statuses[1].startswith("skipped")
  printed = capsys.readouterr().out
  assert "| op | out of time |" in printed and "| mqar | skipped" in printed
  record = json.loads(pathlib.Path(result["record"]).read_text())
  assert record["benchmark"] == "gpu_round" and record["table"]["rows"][0][1] == "out of time"


def test_a_tiny_round_on_cpu_writes_every_record(tmp_path, capsys):
  """The op and MQAR parts at tiny shapes: their records, logs and the round's summary."""
  result = gpu_round.main(["--tiny", "--skip_tests", "--only", "op", "mqar", "--out",
                           str(tmp_path)])
  assert [o["status"] for o in result["outcomes"]] == ["ok", "ok"], result
  names = sorted(p.name.split("_20")[0] for p in tmp_path.glob("*.json"))
  assert names == ["gpu_round", "mqar_step_profile", "op_bench"]
  assert (tmp_path / "op.log").exists() and (tmp_path / "mqar.log").exists()
  printed = capsys.readouterr().out
  assert "| op | ok |" in printed and "0 wrong" in printed and "device step" in printed
  assert "| tiny | " in printed  # the op summary table


@pytest.mark.slow
def test_a_whole_tiny_round_on_cpu(tmp_path):
  """Every part at tiny shapes, the 760M step's memory reports kept as .txt.gz."""
  result = gpu_round.main(["--tiny", "--skip_tests", "--out", str(tmp_path)])
  assert all(o["status"] == "ok" for o in result["outcomes"]), result
  record = json.loads(pathlib.Path(result["record"]).read_text())
  assert len(record["figures"]["memory_usage_reports"]) == 2
  assert not any(p.is_dir() for p in tmp_path.iterdir())  # XLA dumps and traces removed


def test_fla_refuses_a_bad_shape(monkeypatch, capsys):
  from benchmarks.op import fla
  monkeypatch.setattr(fla, "unavailable_reason", lambda: None)
  monkeypatch.setattr(fla, "_allow_hopper_backward", lambda: None)
  monkeypatch.setattr(sys, "argv", ["fla", "4,4096,16,16,32"])
  with pytest.raises(SystemExit) as exit_info:
    fla.main()
  assert exit_info.value.code == 1 and "K >= 32" in capsys.readouterr().err


def test_the_fla_tuning_command_parses_as_the_round_writes_it(monkeypatch, capsys):
  """The background command's shapes and --impls reach benchmarks.op.fla as meant (a shape is
  not taken for an implementation name)."""
  from benchmarks.op import fla
  timed = []
  monkeypatch.setattr(fla, "unavailable_reason", lambda: None)
  monkeypatch.setattr(fla, "_allow_hopper_backward", lambda: None)
  monkeypatch.setattr(fla, "time_ms", lambda impl, mode, shape: timed.append(
      (impl, mode, shape)) or 1.0)
  fla.main(["4,4096,16,96,192", "4,4096,16,48,48", "--impls", "fla_gated_deltanet"])
  assert timed == [("fla_gated_deltanet", mode, shape)
                   for shape in ((4, 4096, 16, 96, 192), (4, 4096, 16, 48, 48))
                   for mode in ("fwd", "fwd+bwd")]
