"""benchmarks/mqar_step_profile.py on CPU: a small batched group, its times and its record."""

import json

import pytest

from benchmarks import mqar_step_profile


def test_group_configs_take_the_paper_preset_and_the_rates_and_seeds():
  configs = mqar_step_profile.group_configs("model=mamba2,num_train_examples=512", 5)
  assert [c.optimizer.learning_rate for c in configs] == [1e-3, 2.15e-3, 4.64e-3, 1e-2, 1e-3]
  assert [c.seed for c in configs] == [0, 0, 0, 0, 1]
  assert configs[0].seq_len == 512 and configs[0].data.vocab_size == 8192  # the paper's
  (cpu,) = mqar_step_profile.group_configs("preset=cpu", 1)
  assert cpu.seq_len == 32


def test_cpu_run_writes_json_and_record(tmp_path):
  out = tmp_path / "profile.json"
  result = mqar_step_profile.main([
      "--config", "preset=cpu,num_train_examples=256,num_test_examples=32", "--runs", "2",
      "--steps", "2",
      "--trace_steps", "1", "--top", "4", "--trace_dir", str(tmp_path / "trace"),
      "--output", str(out), "--records", str(tmp_path / "records")])
  saved = json.loads(out.read_text())
  assert saved["runs"] == 2 and saved["label"].startswith("MQAR palimpsa_d float32, L=32")
  for key in ("host_batch_ms", "device_step_ms", "loop_step_ms"):
    assert saved[key] > 0 and saved[key] == result[key]
  (path,) = (tmp_path / "records").glob("mqar_step_profile_*.json")
  record = json.loads(path.read_text())
  assert len(record["table"]["rows"]) == 4
  assert record["figures"]["loop_step_ms"] == pytest.approx(saved["loop_step_ms"])
  assert any(k["source"].startswith("palimpsa_jax/") for k in saved["kernels"])
  by_file = saved["ms_per_step_by_file"]
  assert by_file == record["figures"]["ms_per_step_by_file"]
  assert sum(by_file.values()) == pytest.approx(sum(k["ms_per_step"] for k in saved["kernels"]))
  assert any(name.startswith("palimpsa_jax/ops/token_loss/") for name in by_file)
