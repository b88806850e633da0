"""benchmarks/mqar/batched_throughput.py: the record of the measured rates."""

import argparse
import json

from benchmarks.mqar import batched_throughput as mqar_batched_throughput


def _measured(mode, runs, impl, total):
  return {"mode": mode, "mixer": "mamba2", "runs": runs, "impl": impl, "xla_flag": "",
          "setting": "512:128", "device": "NVIDIA H200", "backend": "gpu", "jax": "0.11.2",
          "steps": 150, "steps_per_sec_per_run": total / runs, "total_steps_per_sec": total}


def test_record_has_each_mixers_rates_and_the_failed_attempts(tmp_path):
  records = [{"mode": "batched", "mixer": "mamba2", "runs": 12, "impl": "auto",
              "xla_flag": "", "error": "exit code 1"},
             _measured("batched", 6, "auto", 120.0), _measured("single", 1, "auto", 20.0)]
  summary = {"mamba2": {"batched_total_steps_per_sec": 120.0, "single_steps_per_sec": 20.0,
                        "speedup_over_one_single_process": 6.0}}
  args = argparse.Namespace(setting="512:128", runs=12, steps=150, single_steps=300,
                            records=str(tmp_path))
  mqar_batched_throughput.write_record(records, summary, args, "python -m benchmarks.m")
  (path,) = tmp_path.glob("mqar_batched_throughput_*.json")
  record = json.loads(path.read_text())
  assert (record["device"], record["backend"], record["versions"]) == (
      "NVIDIA H200", "gpu", {"jax": "0.11.2"})
  assert record["table"]["rows"] == [["mamba2", "6", "auto", "120.0", "20.0", "6.00"]]
  assert record["notes"][1] == "batched mamba2 x12 impl=auto: exit code 1"


def test_no_record_without_a_measurement(tmp_path):
  args = argparse.Namespace(setting="512:128", runs=12, steps=150, single_steps=300,
                            records=str(tmp_path))
  mqar_batched_throughput.write_record([{"mode": "single", "mixer": "mamba2", "runs": 1,
                                         "impl": "auto", "error": "timed out"}], {}, args, "c")
  assert not list(tmp_path.iterdir())
