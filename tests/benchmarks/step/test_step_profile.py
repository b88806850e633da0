"""benchmarks/step/profile.py: kernel attribution (synthetic GPU trace), its flags, and CPU runs
of the language model's step and of the MQAR sweep's batched group."""

import json
import pathlib
import re
import subprocess
import sys

import pytest

from benchmarks.step import profile as step_profile
from palimpsa_jax import user_errors

HLO = """HloModule jit_step, is_scheduled=true

FileNames
1 "/repo/palimpsa_jax/layers/mlp.py"
2 "/usr/lib/python3.12/site-packages/jax/_src/numpy.py"

FunctionNames
1 "SwiGLU.__call__"
2 "einsum"

FileLocations
1 {file_name_id=1 function_name_id=1 line=33 end_line=33 column=1 end_column=9}
2 {file_name_id=2 function_name_id=2 line=10 end_line=10 column=1 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}


ENTRY %main (p: f32[8,16]) -> f32[8,16] {
  %p = f32[8,16]{1,0} parameter(0)
  %loop_multiply_fusion.3 = bf16[8,16]{1,0} fusion(%p), kind=kLoop, calls=%f, metadata={op_name="jit(step)/mul" stack_frame_id=2}
  %custom-call.7 = (f32[8,16]{1,0}, f32[8]{0}) custom-call(%p), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/pallas_call" stack_frame_id=1}, backend_config={grid_x = 4 : i32, name = "my_walk", num_warps = 1 : i32}
  %while.4 = (s32[], f32[8,16]{1,0}, (f32[], s32[])) while(%t), condition=%c, body=%b
  ROOT %copy.2 = f32[8,16]{0,1} copy(%p)
}
"""


def _event(name, dur, pid=1):
  return {"ph": "X", "pid": pid, "tid": 1, "name": name, "dur": dur, "ts": 0}


def test_kernel_times_per_step_categories_and_sources():
  events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
  for _ in range(2):  # two traced steps
    events += [_event("loop_multiply_fusion_3", 100.0), _event("my_walk", 300.0),
               _event("my_walk", 100.0), _event("nvjet_sm90_tst_128x128", 50.0),
               _event("MemcpyD2D", 10.0), _event("copy_2", 20.0),
               _event("palimpsa_boundary_mosaic_mosaic_gpu_kernel", 30.0),
               _event("PjitFunction(step)", 9999.0, pid=2)]
  rows = step_profile.kernel_times(events, HLO, "jit_step", 2, "/repo")
  by_name = {r.name: r for r in rows}
  assert [r.name for r in rows][0] == "my_walk"
  walk = by_name["my_walk"]
  assert (walk.ms_per_step, walk.calls_per_step, walk.category) == (0.4, 2, "Pallas kernel")
  assert walk.source == "palimpsa_jax/layers/mlp.py:33 (SwiGLU.__call__)"
  assert walk.shape.startswith("(f32[8,16]")
  fusion = by_name["loop_multiply_fusion_3"]
  assert (fusion.category, fusion.shape, fusion.op) == ("XLA fusion", "bf16[8,16]{1,0}",
                                                         "jit(step)/mul")
  # The innermost frame is in site-packages: the source is its project caller.
  assert fusion.source == "palimpsa_jax/layers/mlp.py:33 (SwiGLU.__call__)"
  assert by_name["nvjet_sm90_tst_128x128"].category == "GEMM"
  assert by_name["MemcpyD2D"].category == "copy / memset"
  assert by_name["copy_2"].category == "copy / memset"
  assert "PjitFunction(step)" not in by_name
  # A Mosaic GPU kernel's call carries no name in the HLO: its kernel name says what it is.
  assert by_name["palimpsa_boundary_mosaic_mosaic_gpu_kernel"].category == "Pallas kernel"
  table = step_profile.format_table(rows, 3, step_ms=1.0)
  assert "| Pallas kernel | 0.43 |" in table


def test_cpu_trace_skips_control_flow_but_keeps_custom_calls():
  events = [{"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
  for name, dur in (("while.4", 500.0), ("custom-call.7", 40.0),
                    ("loop_multiply_fusion.3", 30.0)):
    events.append({"ph": "X", "pid": 2, "tid": 1, "name": name, "dur": dur, "ts": 0,
                   "args": {"hlo_module": "jit_step", "hlo_op": name}})
  events.append({"ph": "X", "pid": 2, "tid": 1, "name": "other", "dur": 9.0, "ts": 0,
                 "args": {"hlo_module": "jit_other", "hlo_op": "copy.2"}})
  rows = step_profile.kernel_times(events, HLO, "jit_step", 1, "/repo")
  assert [(r.name, r.ms_per_step, r.category) for r in rows] == [
      ("custom-call.7", 0.04, "other"), ("loop_multiply_fusion.3", 0.03, "XLA fusion")]


def test_a_language_model_run_on_cpu_writes_json_and_record(tmp_path):
  out = tmp_path / "profile.json"
  result = step_profile.main([
      "--size", "tiny", "--seq_len", "64", "--batch_size", "2", "--steps", "2",
      "--trace_steps", "2", "--warmup_steps", "1", "--top", "5", "--trace_dir",
      str(tmp_path / "trace"), "--output", str(out), "--records", str(tmp_path / "records")])
  saved = json.loads(out.read_text())
  assert saved["kernels"] == result["kernels"]
  assert saved["device_step_ms"] > 0 and saved["traced_step_ms"] > 0
  assert "host_batch_ms" not in saved  # the language model's batch stays on the device
  (path,) = (tmp_path / "records").glob("step_profile_*.json")
  record = json.loads(path.read_text())
  assert record["command"].startswith("python -m benchmarks.step.profile --size tiny")
  assert record["settings"]["size"] == "tiny" and len(record["table"]["rows"]) == 5
  categories = record["figures"]["ms_per_step_by_category"]
  assert sum(categories.values()) == pytest.approx(record["figures"]["device_ms_per_step"])
  assert sum(record["figures"]["ms_per_step_by_file"].values()) == pytest.approx(
      record["figures"]["device_ms_per_step"])
  kernels = saved["kernels"]
  assert kernels and all(k["ms_per_step"] >= 0 for k in kernels)
  assert {k["category"] for k in kernels} <= set(step_profile.CATEGORIES)
  assert any(k["source"].startswith("palimpsa_jax/") for k in kernels)


def test_group_configs_take_the_paper_preset_and_the_rates_and_seeds():
  configs = step_profile.group_configs("model=mamba2,num_train_examples=512", 5)
  assert [c.optimizer.learning_rate for c in configs] == [1e-3, 2.15e-3, 4.64e-3, 1e-2, 1e-3]
  assert [c.seed for c in configs] == [0, 0, 0, 0, 1]
  assert configs[0].seq_len == 512 and configs[0].data.vocab_size == 8192  # the paper's
  (cpu,) = step_profile.group_configs("preset=cpu", 1)
  assert cpu.seq_len == 32


def test_an_mqar_run_on_cpu_writes_json_and_record(tmp_path):
  out = tmp_path / "profile.json"
  result = step_profile.main([
      "--mqar", "preset=cpu,num_train_examples=256,num_test_examples=32", "--runs", "2",
      "--steps", "2", "--trace_steps", "1", "--top", "4", "--trace_dir", str(tmp_path / "trace"),
      "--output", str(out), "--records", str(tmp_path / "records")])
  saved = json.loads(out.read_text())
  assert saved["runs"] == 2 and saved["label"].startswith("MQAR palimpsa_d float32, L=32")
  for key in ("host_batch_ms", "device_step_ms", "loop_step_ms"):
    assert saved[key] > 0 and saved[key] == result[key]
  (path,) = (tmp_path / "records").glob("mqar_step_profile_*.json")
  record = json.loads(path.read_text())
  assert record["command"].startswith("python -m benchmarks.step.profile --mqar preset=cpu")
  assert len(record["table"]["rows"]) == 4
  assert record["figures"]["loop_step_ms"] == pytest.approx(saved["loop_step_ms"])
  assert any(k["source"].startswith("palimpsa_jax/") for k in saved["kernels"])
  by_file = saved["ms_per_step_by_file"]
  assert by_file == record["figures"]["ms_per_step_by_file"]
  assert sum(by_file.values()) == pytest.approx(sum(k["ms_per_step"] for k in saved["kernels"]))
  assert any(name.startswith("palimpsa_jax/ops/token_loss/") for name in by_file)


def test_each_step_takes_its_defaults():
  lm = step_profile.parse_args([])
  assert (lm.mqar, lm.models, lm.size, lm.batch_size, lm.seq_len, lm.scan_layers) == (
      None, "palimpsa_d", "170m", 4, 4096, False)
  mqar = step_profile.parse_args(["--mqar", "--steps", "5"])
  assert (mqar.mqar, mqar.runs, mqar.steps, mqar.size) == ("", 1, 5, None)
  assert step_profile.parse_args(["--mqar", "model=mamba2"]).mqar == "model=mamba2"


@pytest.mark.parametrize("argv, refusal", [
    (["--steps", "0"], "--steps"), (["--trace_steps", "0"], "--trace_steps"),
    (["--models", "gpt"], "--models takes one model"),
    (["--models", "palimpsa_d,mamba2"], "--models takes one model"),
    (["--implementation", "fast"], "--implementation"), (["--size", "1b"], "--size"),
    (["--mqar", "--size", "tiny", "--remat"],
     "--size, --remat: for the language model's step, not --mqar's"),
    (["--runs", "2"], "--runs: for the MQAR step only; add --mqar")])
def test_bad_arguments_are_refused(argv, refusal):
  with pytest.raises(user_errors.UserError, match=re.escape(refusal)):
    step_profile.parse_args(argv)


def test_the_command_refuses_in_one_line():
  done = subprocess.run([sys.executable, "-m", "benchmarks.step.profile", "--runs", "2"],
                        capture_output=True, text=True, check=False,
                        cwd=pathlib.Path(__file__).parents[3])
  assert (done.returncode, done.stdout) == (1, "")
  assert done.stderr.startswith("benchmarks.step.profile: --runs: for the MQAR step only")
  assert done.stderr.count("\n") == 1
