"""benchmarks/op/profile.py: a CPU run of the trace's two modes; parsing ncu's exported pages
and their summary; argument checks."""

import json
import subprocess
import sys

import pytest

from benchmarks.op import profile
from benchmarks.step import profile as step_profile


def test_cpu_run_profiles_both_modes(tmp_path):
  out = tmp_path / "profile.json"
  result = profile.main([
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
  assert all(r["benchmark"] == "op_profile" and r["command"].startswith(
      "python -m benchmarks.op.profile --shapes small") for r in records)
  assert sorted(r["settings"]["mode"] for r in records) == ["fwd", "fwd+bwd"]
  for record in records:
    mode = saved["modes"][record["settings"]["mode"]]
    assert record["figures"]["wall_ms_per_call"] == mode["wall_ms"]
    assert len(record["table"]["rows"]) == min(5, len(mode["kernels"]))
    assert record["table"]["rows"][0][0] == mode["kernels"][0]["name"][:60]



# A piece of an ncu details page, as `ncu --import R --page details` prints it.
DETAILS = """\
  palimpsa_walk_backward_mosaic_mosaic_gpu_kernel (72, 4, 64)x(128, 1, 1), Context 1, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    Duration                         ms         9.92
    Elapsed Cycles                cycle    4,775,576
    ----------------------- ----------- ------------
    Section: Compute Workload Analysis
    Executed Ipc Active   inst/cycle         2.76
    Issue Slots Busy               %        68.96
    Avg. Active Threads Per Warp                                32.00
    Registers Per Thread             register/thread             185
    Executed Instructions                           inst 7,143,364,753
    Duration                         ms         1.00
"""

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
          '"stall_long_sb","stall_wait","stall_selected","stall_wait (Not Issued)"')


def source_page(rows):
  """A source page CSV: (sass, executions, long_sb, wait, selected) per instruction."""
  lines = ['"Kernel Name","palimpsa_walk_backward_mosaic_mosaic_gpu_kernel",', HEADER]
  for i, (sass, runs, long_sb, wait, selected) in enumerate(rows):
    lines.append(f'"0x{i * 16:x}","      {sass}","0","{runs}","{long_sb}","{wait}",'
                 f'"{selected}","99"')
  return "\n".join(lines) + "\n"


# MQAR: 64 * 1024 * 8 * 16 * 32 elements = 8,388,608 warp-wide entry-steps.
MQAR_ENTRY_STEPS = 64 * 1024 * 8 * 16 * 32 // 32
ROWS = [("FFMA R1, R2, R3, R4", 2 * MQAR_ENTRY_STEPS, 0, 3, 5),
        ("@!P0 FMUL R1, R2, R3", 2 * MQAR_ENTRY_STEPS, 2, 0, 4),
        ("MUFU.RCP R5, R6", 2 * MQAR_ENTRY_STEPS, 0, 1, 1),
        ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR6], R12", 1000, 4, 0, 0),
        ("", 0, 0, 0, 0)]


def test_details_page_values_units_and_first_of_repeats():
  metrics = profile.parse_details(DETAILS)
  assert metrics["Duration"] == (9.92, "ms")
  assert metrics["Elapsed Cycles"] == (4775576.0, "cycle")
  assert metrics["Executed Instructions"] == (7143364753.0, "inst")
  assert metrics["Avg. Active Threads Per Warp"] == (32.0, "")
  assert metrics["Registers Per Thread"] == (185.0, "register/thread")


def test_source_page_counts_opcodes_stalls_and_the_hottest_block():
  counts = profile.parse_source(source_page(ROWS))
  assert counts.opcodes == {"FFMA": 2 * MQAR_ENTRY_STEPS, "FMUL": 2 * MQAR_ENTRY_STEPS,
                            "MUFU": 2 * MQAR_ENTRY_STEPS, "SYNCS": 1000}
  assert counts.stalls == {"long_sb": 6, "wait": 4, "selected": 10}  # Not the "Not Issued"
  assert (counts.hot_block_size, counts.hot_block_runs) == (3, 2 * MQAR_ENTRY_STEPS)


def test_source_page_without_a_header_is_refused():
  with pytest.raises(ValueError, match="not an ncu source page"):
    profile.parse_source("Kernel Name,x\n1,2\n")


def test_summary_of_exported_pages_per_entry_and_step(tmp_path):
  (tmp_path / "details.txt").write_text(DETAILS)
  (tmp_path / "source.csv").write_text(source_page(ROWS))
  profile.main(["--shape", "MQAR", "--ncu", "walk_bwd", "--from_report",
                       str(tmp_path / "details.txt"), str(tmp_path / "source.csv"),
                       "--device", "NVIDIA H200", "--note", "from a test",
                       "--records", str(tmp_path / "records")])
  [path] = (tmp_path / "records").glob("kernel_profile_*.json")
  record = json.loads(path.read_text())
  assert record["device"] == "NVIDIA H200" and record["settings"]["shape"] == "MQAR"
  assert record["command"].startswith("python -m benchmarks.op.profile --shape MQAR --ncu")
  rows = {row[0]: row[1:] for row in record["table"]["rows"]}
  assert rows["FFMA"] == ["2.00", "33.3%"] and rows["MUFU"] == ["2.00", "33.3%"]
  assert rows["all"][0] == "6.00"
  assert any("registers per thread | 185 register/thread" in n for n in record["notes"])
  assert any("long_sb | 30.0%" in n for n in record["notes"]) and "from a test" in record["notes"]


def test_ncu_profiles_this_command_s_stage_child_and_summarizes_its_pages(monkeypatch, tmp_path):
  """With ncu on PATH (here a stand-in): ncu runs this command's --run_stage child for the
  stage's Mosaic kernel, the report's pages are exported into --keep and summarized."""
  calls = []

  def ncu(command, **kwargs):
    calls.append(command)
    page = command[command.index("--page") + 1] if "--page" in command else None
    stdout = {"details": DETAILS, "source": source_page(ROWS)}.get(page, "")
    return subprocess.CompletedProcess(command, 0, stdout=stdout)

  monkeypatch.setattr(profile.shutil, "which", lambda name: "/opt/ncu")
  monkeypatch.setattr(profile.subprocess, "run", ncu)
  profile.main(["--shape", "MQAR", "--ncu", "walk_bwd", "--keep", str(tmp_path / "prof"),
                "--no_record"])
  run, *exports = calls
  assert run[run.index("--kernel-name") + 1] == "regex:^palimpsa_walk_backward_mosaic"
  child = run[run.index(sys.executable):]
  assert child[1:3] == ["-m", "benchmarks.op.profile"]
  args = profile.parse_args(child[3:])
  assert (args.shape, args.ncu, args.run_stage) == ("MQAR", "walk_bwd", True)
  assert [e[e.index("--page") + 1] for e in exports] == ["details", "source"]
  assert (tmp_path / "prof" / "details.txt").read_text() == DETAILS


def test_the_ncu_child_refuses_a_stage_without_its_mosaic_kernel():
  """On a CPU (as on a GPU before sm_90) the stage would run its Triton kernel."""
  with pytest.raises(SystemExit, match="runs it with triton, not Mosaic GPU"):
    profile.main(["--shapes", "small", "--shape", "tiny", "--ncu", "walk_fwd", "--run_stage"])


def test_without_ncu_it_says_what_is_needed(monkeypatch, tmp_path):
  monkeypatch.setattr(profile.shutil, "which", lambda name: None)
  with pytest.raises(SystemExit, match="needs Nsight Compute"):
    profile.main(["--shape", "D170", "--ncu", "walk_fwd", "--keep", str(tmp_path)])


@pytest.mark.parametrize("argv", [
    ["--shape", "D999"], ["--shapes", "small", "--shape", "D170"], ["--impl", "fast"],
    ["--calls", "0"], ["--warmup", "-1"], ["--modes", "bwd"], ["--ncu", "carries"],
    ["--ncu", "walk_bwd", "--from_report", "a", "b"], ["--keep", "/tmp/prof"],
    ["--from_report", "a", "b", "--device", "NVIDIA H200"]])
def test_bad_arguments_exit(argv):
  with pytest.raises(SystemExit):
    profile.parse_args(argv)
